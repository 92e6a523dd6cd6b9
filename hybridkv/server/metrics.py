"""Prometheus metrics in vLLM's style, under the `hybridkv:` prefix.

Engine gauges and counters (requests running / waiting / swapped, KV blocks, state slots, prefix
cache, preemptions by mode, swaps, migrations, state checkpoints per tier as
`checkpoint_tier_*{tier=...}`, the prefix-hit guard's checks and mismatches) are read from `LLM.stats()` at each scrape; the
request-level ones (token counters, time to first token, inter-token and end-to-end latency)
are observed by the server as requests stream.
"""
from __future__ import annotations

import time
from typing import Optional

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_P = "hybridkv:"
disable_created_metrics()  # no *_created series (as vLLM): they double the text for nothing
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)

# (kind, metric name after "checkpoint_tier_", key in stats["checkpoint_tiers"][tier], help)
_TIER_SERIES = (
    ("gauge", "entries", "entries", "State checkpoints held, per tier."),
    ("gauge", "bytes", "bytes", "Bytes of the state checkpoints held, per tier."),
    ("gauge", "budget_bytes", "budget_bytes", "Byte budget of the tier (host and disk)."),
    ("counter", "hits", "hits", "Admissions that used a checkpoint of the tier."),
    ("counter", "promotions", "promotions", "States copied from the tier into a device slot."),
    ("counter", "promotion_seconds", "promotion_seconds", "Seconds spent copying promoted states."),
    ("counter", "demotions", "demotions", "States taken into the tier from the device."),
    ("counter", "refused_demotions", "refused_demotions", "Evicted states not worth the tier's bytes (dropped)."),
    ("counter", "evictions", "evictions", "Checkpoints evicted from the tier for room."),
    ("counter", "refused_corrupt", "refused_corrupt", "Entries that failed the key/layout/CRC check (dropped unused)."),
    ("gauge", "swap_bytes", "swap_bytes", "Bytes of swapped-out requests the tier's budget holds (host only)."),
    ("counter", "swaps_refused", "swaps_refused", "Swap preemptions the budget could not hold: preempted by "
     "recompute instead (host only)."),
    ("gauge", "pinned_entries", "pinned_entries", "Pinned turns' states held before their deadline (host only)."),
    ("counter", "pinned_demotions", "pinned_demotions", "Pinned states taken in from the device with their pin."),
    ("counter", "refused_pinned", "refused_pinned", "Pinned states that did not fit beside the tier's pins "
     "(dropped: their pin lost)."),
    ("gauge", "kv_pinned_entries", "kv_pinned_entries", "Pinned turns' KV blocks held before their deadline "
     "(host only)."),
    ("gauge", "kv_entries", "kv_entries", "KV blocks held (host and disk)."),
    ("gauge", "kv_bytes", "kv_bytes", "Bytes of the KV blocks held (host only)."),
    ("counter", "kv_promotions", "kv_promotions", "KV blocks loaded from the tier into device blocks (host and disk)."),
    ("counter", "kv_demotions", "kv_demotions", "KV blocks copied to the host as the device evicted them, or "
     "queued for writing to the disk."),
    ("counter", "kv_evictions", "kv_evictions", "KV blocks dropped from the tier for room (host only)."),
    ("counter", "kv_refused_corrupt", "kv_refused_corrupt", "KV blocks that failed the layout/CRC check (host "
     "only; dropped unused)."),
    ("counter", "kv_promotion_seconds", "kv_promotion_seconds", "Seconds spent promoting KV blocks (host only)."),
    ("counter", "write_seconds", "write_seconds", "Seconds the tier's writer spent writing entries (disk only)."),
    ("counter", "write_errors", "write_errors", "Entries whose write failed (disk only; logged, dropped)."),
    ("counter", "dropped_writes", "dropped_writes", "Entries not written: too many writes were pending (disk only)."),
    ("counter", "background_reads", "background_reads", "Entries read and verified ahead of admission on the "
     "reader thread (disk only; failures included)."),
    ("counter", "background_read_seconds", "background_read_seconds", "Seconds the reader thread spent reading "
     "and verifying entries (disk only)."),
    ("counter", "sync_reads", "sync_reads", "Entries the admission read on the engine step's thread: nothing "
     "read them ahead (disk only)."),
    ("counter", "read_wait_seconds", "read_wait_seconds", "Seconds requests were held back while their entries "
     "were read ahead (disk only; summed over requests)."),
)


class _EngineCollector:
    """Turns the latest `LLM.stats()` dict into metric families at scrape time."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: Optional[dict] = None

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(_P + name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, values: dict[str, float], label: Optional[str] = None):
        c = CounterMetricFamily(_P + name, doc, labels=["model_name"] + ([label] if label else []))
        for key, v in values.items():
            c.add_metric([self.model_name] + ([key] if label else []), v)
        return c

    def collect(self):
        s = self.stats
        if s is None:
            return
        yield self._gauge("num_requests_running", "Requests being computed.", s["running"])
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"])
        yield self._gauge("num_requests_swapped", "Requests swapped out to host memory.", s["swapped"])
        total = s["kv_blocks_total"] or 1
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).",
                          s["kv_blocks_used"] / total)
        yield self._gauge("kv_blocks_used", "KV blocks held by requests.", s["kv_blocks_used"])
        yield self._gauge("kv_blocks_cached", "Free KV blocks still findable by prefix hash.", s["kv_blocks_cached"])
        yield self._gauge("kv_blocks_total", "KV blocks in the pool.", s["kv_blocks_total"])
        yield self._gauge("state_slots_live", "Recurrent state slots held by running sequences.",
                          s["state_slots_live"])
        yield self._gauge("state_slots_checkpoint", "Recurrent state slots holding prefix checkpoints.",
                          s["state_slots_checkpoint"])
        yield self._gauge("state_slots_total", "Recurrent state slots in the pool.", s["state_slots_total"])
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            {"": s["prefix_query_tokens"]})
        yield self._counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                            {"": s["prefix_hit_tokens"]})
        yield self._counter("prefix_cache_misses", "Requests that missed the prefix cache, by reason.",
                            s["prefix_misses"], "reason")
        yield self._counter("num_preemptions", "Sequences preempted, by mode.", s["preemptions"], "mode")
        yield self._counter("num_swaps", "Sequences swapped out to host memory.", {"": s["swaps"]})
        yield self._counter("num_migrations", "Requests migrated, by direction.", s["migrations"], "direction")
        yield self._counter("num_forks", "Sequences forked from a shared prompt (n > 1).", {"": s["forks"]})
        yield self._counter("num_aborted_requests", "Requests aborted (client gone or cancelled).",
                            {"": s["aborted"]})
        yield self._counter("spec_decode_num_drafts", "Draft runs verified (speculative decoding).",
                            {"": s["spec_verify_runs"]})
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.", {"": s["spec_draft_tokens"]})
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            {"": s["spec_accepted_tokens"]})
        yield self._gauge("spec_decode_acceptance_rate", "Accepted over drafted tokens since start.",
                          s["spec_acceptance_rate"])
        yield self._gauge("spec_decode_mean_accepted_length", "Tokens a verification run yields on average "
                          "(accepted + 1).", s["spec_mean_accepted_length"])
        d = s["spec_draft_model"]
        yield self._counter("spec_decode_draft_model_forwards", "Forward passes of the draft model (method draft_model).",
                            {"": d["forwards"]})
        yield self._counter("spec_decode_draft_model_tokens", "Positions the draft model computed: real (the "
                            "target's tokens, each once) or speculative (its own proposals).",
                            {"real": d["real_tokens"], "speculative": d["speculative_tokens"]}, "kind")
        yield self._counter("spec_decode_draft_model_evictions", "Draft requests freed for room in the draft's pools.",
                            {"": d["evictions"]})
        yield self._counter("cache_hit_checks", "Prefix hits recomputed cold and compared (verify_cache_hits).",
                            {"": s["cache_hit_checks"]})
        yield self._counter("cache_hit_mismatches", "Checked prefix hits whose logits differed from the cold "
                            "recompute (the entry was invalidated).", {"": s["cache_hit_mismatches"]})
        yield from self._tiers(s.get("checkpoint_tiers", {}))
        pins = s.get("cache_pins", {})
        if pins:  # pinned turns (SamplingParams.cache_pin_ttl_s)
            yield self._counter("cache_pinned_turns", "Requests that ended with a pin (cache_pin).", {"": pins["turns"]})
            yield self._gauge("cache_pinned_blocks", "KV blocks pinned now.", pins["blocks"])
            yield self._gauge("cache_pinned_states", "State checkpoints pinned now.", pins["states"])
            yield self._counter("cache_pins_reclaimed", "Pinned KV blocks and states taken before their deadline "
                                "because a running request needed the memory.",
                                {"blocks": pins["reclaimed_blocks"], "states": pins["reclaimed_states"]}, label="what")
        if "replicas" in s:  # data-parallel replicas (server/replicas.py): the sums above, and each one
            yield from self._per_replica(s["replicas"])

    def _tiers(self, tiers: dict[str, dict]):
        """State checkpoints per tier ("device", "host", "disk"), labelled `tier`; a series only for the
        tiers whose stats carry that key (promotions, demotions... are the host's)."""
        for kind, name, key, doc in _TIER_SERIES:
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                _P + "checkpoint_tier_" + name, doc, labels=["model_name", "tier"])
            for tier, st in tiers.items():
                if key in st:
                    fam.add_metric([self.model_name, tier], st[key])
            if fam.samples:
                yield fam

    def _per_replica(self, replicas: list[dict]):
        lab = ["model_name", "replica"]
        for name, doc, value in (
                ("replica_up", "1 while the data-parallel replica runs, 0 once it died.", lambda r: float(r["alive"])),
                ("replica_num_requests_running", "Requests being computed, per replica.", lambda r: r["running"]),
                ("replica_num_requests_waiting", "Requests waiting, per replica.", lambda r: r["waiting"]),
                ("replica_kv_cache_usage_perc", "Fraction of KV blocks held, per replica.",
                 lambda r: r["kv_blocks_used"] / (r["kv_blocks_total"] or 1)),
                ("replica_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up, "
                 "per replica.", lambda r: r["prefix_hit_rate"])):
            g = GaugeMetricFamily(_P + name, doc, labels=lab)
            for r in replicas:
                if r["alive"] or name == "replica_up":
                    g.add_metric([self.model_name, str(r["replica"])], value(r))
            yield g


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        r, lab, m = self.registry, ["model_name"], model_name
        self.prompt_tokens = Counter(_P + "prompt_tokens", "Prompt tokens of finished requests.", lab,
                                     registry=r).labels(m)
        self.generation_tokens = Counter(_P + "generation_tokens", "Tokens generated.", lab,
                                         registry=r).labels(m)
        self.request_success = Counter(_P + "request_success", "Finished sequences, by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.ttft = Histogram(_P + "time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(m)
        self.itl = Histogram(_P + "inter_token_latency_seconds", "Time between two streamed deltas.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram(_P + "e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(m)
        self.model_name = model_name

    def render(self, stats: dict) -> bytes:
        """Prometheus text for the current engine `stats` and the request metrics so far."""
        self.engine.stats = stats
        return generate_latest(self.registry)


class RequestTimer:
    """Latencies of one request (all its sequences), observed into `ServerMetrics` as deltas come."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.t0 = time.monotonic()
        self.first: Optional[float] = None
        self.last: dict[int, float] = {}
        self.generated = 0

    def on_tokens(self, index: int, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.t0)
        elif index in self.last:
            self.m.itl.observe(now - self.last[index])
        self.last[index] = now
        self.generated += n
        self.m.generation_tokens.inc(n)

    def on_finish(self, reason: str) -> None:
        self.m.request_success.labels(self.m.model_name, reason).inc()

    def done(self, prompt_tokens: int) -> float:
        """Record the request's end; returns its end-to-end seconds."""
        e2e = time.monotonic() - self.t0
        self.m.e2e.observe(e2e)
        self.m.prompt_tokens.inc(prompt_tokens)
        return e2e

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first is None else self.first - self.t0
