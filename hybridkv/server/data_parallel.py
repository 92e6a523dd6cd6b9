"""`DataParallelLLM`: N engine processes behind one server, with AsyncLLM's interface.

    engine = DataParallelLLM(path, data_parallel_size=2, **llm_kwargs)   # or AsyncLLM.create(..., data_parallel_size=2)
    stream = await engine.add_request(ids, params, "req-1"); async for d in stream: ...
    await engine.stats()   # summed over replicas, plus "replicas": [per-replica stats]

Each replica is a spawned process running its own LLM and engine loop (engine_process.py); a
pipe carries commands one way and request news the other (replica_set.py); here the news goes
to the caller's event loop. A new request goes where `PrefixRouter` says (the longest
usable cached prefix, asked of every replica, else the least loaded). A balancer thread moves
requests off a replica with requests waiting as `Balancer` (balancing.py) decides: running ones
carry KV and state (tensors rank to rank over the replicas' gloo group, or snapshot bytes in
the pipe); the client's stream goes on from the next token. An add whose replica dies meanwhile goes to the
next best live one. A replica whose pipe closes (its process died) fails its requests with
EngineDeadError naming it; the rest serve on.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace
from typing import Optional

from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.engine_stats import speculation_stats

from .balancing import Balancer
from .news import EngineDeadError
from .replica_messages import ReplicaFacts
from .replica_set import ReplicaSet
from .request_stream import RequestStream, StreamingEngine
from .router import PrefixRouter
from .sink import QueueSink

log = logging.getLogger("hybridkv.replicas")
_SUMMED = ("kv_blocks_used", "kv_blocks_cached", "kv_blocks_total", "state_slots_live", "state_slots_checkpoint",
           "state_slots_total", "prefix_hit_tokens", "prefix_query_tokens", "burst_waits", "swaps", "forks",
           "aborted", "failed", "running", "waiting", "swapped", "steps", "generated_tokens", "tokens_per_second",
           "generated_tokens_per_second", "spec_verify_runs", "spec_draft_tokens", "spec_accepted_tokens",
           "cache_hit_checks", "cache_hit_mismatches")
_SUMMED_BY_KEY = ("prefix_misses", "preemptions", "migrations", "cache_pins", "spec_draft_model")


class DataParallelLLM(StreamingEngine):
    """`data_parallel_size` replicas of `LLM(model, **llm_kwargs)`, one process each.

    `balance_interval` seconds between two looks for an overloaded and an idle replica (0 turns
    migration off); `call_timeout` bounds every wait on a replica; `startup_timeout` the build.
    `migration_transport`: how a running request's KV and state move, "gloo" (tensors rank to
    rank over the replicas' gloo group, the pipe carries a header) or "pipe" (snapshot bytes in
    the pipe message); `transport` can be changed later between the two when the group exists.
    """

    def __init__(self, model: str, data_parallel_size: int, log_stats_interval: float = 10.0,
                 balance_interval: float = 0.05, call_timeout: float = 60.0, startup_timeout: float = 600.0,
                 migration_transport: str = "gloo", **llm_kwargs):
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={data_parallel_size!r}: give an integer >= 1")
        if migration_transport not in ("gloo", "pipe"):
            raise ValueError(f"migration_transport={migration_transport!r}: give 'gloo' or 'pipe'")
        self.size, self.call_timeout, self.transport = data_parallel_size, call_timeout, migration_transport
        self.moves = {"running": 0, "waiting": 0}  # requests moved by the balancer, by what they were
        self._lock = threading.Lock()  # streams, router, requests in transit
        self._streams: dict[str, QueueSink] = {}  # each request's sink on its caller's event loop
        self._moving: set[str] = set()      # may be in transit between replicas: aborts wait
        self._aborted: set[str] = set()     # aborted while in transit
        self.balancer = Balancer()          # which requests move where (balancing.py)
        self.router = PrefixRouter(data_parallel_size, int(llm_kwargs.get("block_size", 16)))
        self.replicas = ReplicaSet(model, data_parallel_size, llm_kwargs, log_stats_interval, self._deliver,
                                   self._replica_died, startup_timeout,
                                   gloo=migration_transport == "gloo" and data_parallel_size > 1,
                                   call_timeout=call_timeout)
        self.facts: list[ReplicaFacts] = self.replicas.facts
        f = self.facts[0]
        self.tokenizer = f.tokenizer
        # what the serving layer reads of an LLM (serving.py): limits and defaults, same on every replica
        self.llm = SimpleNamespace(model=SimpleNamespace(max_model_len=f.max_model_len,
                                                         generation_defaults=f.generation_defaults),
                                   config=SimpleNamespace(max_num_seqs=f.max_num_seqs))
        if balance_interval > 0 and data_parallel_size > 1:
            threading.Thread(target=self._balance_loop, args=(balance_interval,), name="hybridkv-balancer",
                             daemon=True).start()

    # ---- the caller's side ---------------------------------------------------------------------
    @property
    def dead(self) -> Optional[str]:
        """None while every replica runs; else which stopped and why (the others still serve)."""
        dead = dict(self.replicas.dead)
        return "; ".join(dead[i] for i in sorted(dead)) if dead else None

    async def _ask(self, i: int, verb: str, *args):
        return await asyncio.wait_for(asyncio.wrap_future(self.replicas.call(i, verb, *args)), self.call_timeout)

    async def stats(self) -> dict:
        """Every live replica's LLM.stats() summed (hit rate recomputed), and "replicas": a list of
        {"replica", "alive", "pid", **that replica's stats}."""
        alive = self.replicas.alive()
        got = await asyncio.gather(*(self._ask(i, "stats") for i in alive), return_exceptions=True)
        per = {i: s for i, s in zip(alive, got) if isinstance(s, dict)}
        total: dict = {k: 0 for k in _SUMMED}
        for k in _SUMMED_BY_KEY:
            total[k] = {}
        for s in per.values():
            for k in _SUMMED:
                total[k] += s[k]
            for k in _SUMMED_BY_KEY:
                for key, v in s[k].items():
                    total[k][key] = total[k].get(key, 0) + v
        total["checkpoint_tiers"] = tiers = {}  # per tier, every counter and gauge summed
        for s in per.values():
            for tier, st in s.get("checkpoint_tiers", {}).items():
                t = tiers.setdefault(tier, {})
                for key, v in st.items():
                    t[key] = t.get(key, 0) + v
        q = total["prefix_query_tokens"]
        total["prefix_hit_rate"] = total["prefix_hit_tokens"] / q if q else 0.0
        total["fragmentation"] = max((s["fragmentation"] for s in per.values()), default=0.0)
        total.update(speculation_stats(total))  # the rates of the summed counters
        total["replicas"] = [{"replica": i, "alive": i in per, "pid": self.facts[i].pid, **per.get(i, {})}
                             for i in range(self.size)]
        return total

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it runs (does not wait)."""
        with self._lock:
            self._streams.pop(request_id, None)
            replica = self.router.replica_of(request_id)
            if request_id in self._moving:  # sent where it lands (_settle)
                self._aborted.add(request_id)
                return
            self.router.finished(request_id)
        if replica is not None:
            self.replicas.send(replica, ("abort", request_id))

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, cache_salt: Optional[str] = None) -> RequestStream:
        """Route and queue a request (AsyncLLM.add_request's contract): bad input raises
        ValueError / TypeError from the replica and nothing stays queued."""
        ids = list(prompt_token_ids)
        alive = self.replicas.alive()
        probes = await asyncio.gather(*(self._ask(i, "probe", ids, cache_salt) for i in alive),
                                      return_exceptions=True)
        hits: list[Optional[int]] = [None] * self.size
        for i, p in zip(alive, probes):
            hits[i] = None if isinstance(p, BaseException) else p.hit_tokens
        while True:  # a replica that dies between the probe and the add: the next best one
            stream = QueueSink()  # fresh: a dying one posts its error
            with self._lock:
                if request_id in self._streams:
                    raise ValueError(f"request id {request_id!r} is already in use; give another id")
                try:
                    replica = self.router.choose(request_id, ids, params.max_tokens or 0, cache_salt, hits)
                except ValueError:
                    raise EngineDeadError("no data-parallel replica is running: "
                                          + "; ".join(self.replicas.dead.values())) from None
                self._streams[request_id] = stream
            try:
                await self._ask(replica, "add", ids, params, request_id, priority, cache_salt)
                break
            except BaseException as e:
                with self._lock:
                    self._streams.pop(request_id, None)
                    self.router.finished(request_id)
                if isinstance(e, EngineDeadError) and replica in self.replicas.dead:
                    hits[replica] = None
                    continue
                if not isinstance(e, (ValueError, TypeError)):  # cancelled or timed out: it may have been added
                    self.replicas.send(replica, ("abort", request_id))
                raise
        return RequestStream(self, request_id, params, stream)


    def close(self, timeout: float = 10.0) -> None:
        """Stop every replica (requests still running are aborted); waits at most `timeout` each."""
        self.replicas.close(timeout)

    # ---- from the replicas' reader threads ------------------------------------------------------
    def _deliver(self, rid: str, news) -> None:
        with self._lock:
            stream = self._streams.get(rid)
            if stream is None:
                return
            if isinstance(news, BaseException) or news.finished:
                del self._streams[rid]
                self.router.finished(rid)
        if not stream.post(news):  # the caller's event loop is gone: nobody reads this request
            self.abort(rid)

    def _replica_died(self, i: int, why: str) -> None:
        """Replica i is gone: its requests (not those in transit, which _settle places) fail."""
        with self._lock:
            lost = [rid for rid in self._streams if self.router.replica_of(rid) == i and rid not in self._moving]
            streams = [(rid, self._streams.pop(rid)) for rid in lost]
            for rid in lost:
                self.router.finished(rid)
        for rid, stream in streams:
            stream.post(EngineDeadError(f"request {rid}: {why}"))

    # ---- the balancer: queued requests move to a replica with room, running ones to an idle one --
    def _balance_loop(self, interval: float) -> None:
        while not self.replicas.closing.wait(interval):
            with self._lock:
                busy = bool(self._streams)
            if not busy:
                continue
            try:
                self.balance_once()
            except Exception:  # a replica died mid-look: its reader reports it
                log.debug("balancing skipped", exc_info=True)

    def balance_once(self) -> int:
        """One look of the balancer at every live replica's load (balancing.Balancer: waiting
        requests with nothing to gain where they are go to free seats, then running ones to an
        idle replica); returns how many moved."""
        futs = {i: self.replicas.call(i, "probe", [], None) for i in self.replicas.alive()}
        probes = {i: f.result(self.call_timeout) for i, f in futs.items()}
        return self.balancer.look(probes, self._migrate)

    def _migrate(self, a: int, b: int, k: int, waiting: bool = False) -> int:
        """Export up to k requests of replica a (running ones, or `waiting` ones that gain nothing
        by staying: balancing.requests_free_to_leave) and continue them on b (back on a if b refuses; failed with a clear
        error if neither can). An abort that comes meanwhile is held and sent where the request
        lands. Running requests' tensors go as `self.transport` says."""
        with self._lock:  # any of a's requests may leave: aborts wait until we know where it is
            candidates = {rid for rid in self._streams if self.router.replica_of(rid) == a}
            self._moving |= candidates
        rank = b if self.transport == "gloo" and not waiting and self.replicas.gloo else None
        try:
            out = self.replicas.call(a, "export", k, waiting, rank).result(self.call_timeout)
        except Exception as e:
            log.warning("replica %d could not export requests: %s", a, e)
            out = []
        for rid in candidates - {m.request_id for m in out}:
            self._settle(rid, a)
        for m in out:
            landed = None
            for dst in (b, a):
                try:
                    self.replicas.call(dst, "import", m).result(self.call_timeout)
                    landed = dst
                    break
                except Exception as e:
                    log.warning("request %s could not move to replica %d: %s", m.request_id, dst, e)
            self._settle(m.request_id, landed)
        if out:
            self.replicas.send(a, ("forget", [m.request_id for m in out]))
            self.moves["waiting" if waiting else "running"] += len(out)
        return len(out)

    def _settle(self, rid: str, replica: Optional[int]) -> None:
        """Request `rid` is no longer in transit: it runs on `replica` (None: lost). Sends a held
        abort there, or fails its stream when it was lost or its replica died meanwhile."""
        with self._lock:
            self._moving.discard(rid)
            aborted = rid in self._aborted
            self._aborted.discard(rid)
            why = (f"request {rid} was lost in migration: no replica could take it" if replica is None
                   else self.replicas.dead.get(replica))
            if replica is not None and not aborted and why is None:
                self.router.moved(rid, replica)
                return
            self.router.finished(rid)
            stream = self._streams.pop(rid, None)
        if aborted and replica is not None:
            self.replicas.send(replica, ("abort", rid))
        elif stream is not None:
            stream.post(EngineDeadError(f"request {rid}: {why}"))
