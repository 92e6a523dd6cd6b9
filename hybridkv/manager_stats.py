"""The memory manager's counters, as the engine's `stats()` reports them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hybridkv.request import RequestStatus


@dataclass
class ManagerStats:
    """kv_blocks_*: used (refcount > 0), cached (free but still findable by hash), free, total.
    slots_*: live (one per running request), checkpoint, free, total (null slot excluded).
    prefix_*: tokens served from cache, tokens looked up, lookups; misses by reason
    ('no_kv_match', 'kv_match_no_checkpoint', 'caching_off').
    preemptions: by mode ('recompute', 'swap').
    fragmentation: unused token slots in requests' partially filled last blocks / token slots in used blocks.
    The kv_* and slots_* fields sum the attention kind and the recurrent kind; `kinds` has each one.
    tiers: the state checkpoints per tier, {"device": {...}, "host": {...}} (host only with a host
    tier): entries, bytes, hits, evictions; the host's also promotions, demotions, refusals; with a
    disk tier "disk" too (memory/disk_tier.py: its KV blocks as well, writes, corrupt files refused).
    pins: pinned turns (SamplingParams.cache_pin_ttl_s): turns that ended pinned, KV blocks and
    states pinned now in any tier (and of those, on the host), and those lost before their deadline
    (they left every tier because memory ran out).
    """

    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_free: int
    kv_blocks_total: int
    slots_live: int
    slots_checkpoint: int
    slots_free: int
    slots_total: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prefix_queries: int
    prefix_misses: dict[str, int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    fragmentation: float = 0.0
    running_requests: int = 0
    burst_waits: int = 0    # times a request waited a step for a burst leader (memory/burst.py)
    kinds: dict[str, dict] = field(default_factory=dict)  # each kind of memory's own counters
    tiers: dict[str, dict] = field(default_factory=dict)
    pins: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, mgr) -> "ManagerStats":
        """A HybridCacheManager's counters now: kv_blocks_* add up every attention group's pool;
        `kinds` has each group's own counters."""
        kinds = {k.name: k.stats() for k in mgr.kinds}
        a = {key: sum(kinds[g.name][key] for g in mgr.attention_groups.values())
             for key in ("blocks_used", "blocks_cached", "blocks_free", "blocks_total")}
        s = kinds.get(mgr.recurrent.name, {}) if mgr.recurrent is not None else {}
        running = [r for r in mgr.requests.values() if r.status is RequestStatus.RUNNING]
        used, bs = a.get("blocks_used", 0), mgr.block_size
        waste = sum(len(g.block_ids(r.request_id)) * bs - r.num_computed_tokens  # past the last token
                    for g in mgr.attention_groups.values() for r in running)
        hits = mgr.prefix_cache.hits
        tiers = dict(s.get("tiers", {}))
        host_kv = mgr.prefix_cache.host_kv
        if host_kv is not None:  # evicted KV blocks beside the host's states
            tiers["host"] = {**tiers.get("host", {"budget_bytes": host_kv.budget_bytes}), **host_kv.stats()}
        if mgr.disk is not None:
            tiers["disk"] = mgr.disk.stats()
        return cls(
            kv_blocks_used=used, kv_blocks_cached=a.get("blocks_cached", 0), kv_blocks_free=a.get("blocks_free", 0),
            kv_blocks_total=a.get("blocks_total", 0), slots_live=s.get("slots_live", 0),
            slots_checkpoint=s.get("slots_checkpoint", 0), slots_free=s.get("slots_free", 0),
            slots_total=s.get("slots_total", 0), prefix_hit_tokens=hits.hit_tokens,
            prefix_query_tokens=hits.query_tokens, prefix_queries=hits.queries, prefix_misses=dict(hits.misses),
            preemptions=dict(mgr.preemptions), fragmentation=max(0.0, waste / (used * bs)) if used else 0.0,
            running_requests=len(running), burst_waits=mgr.prefix_cache.bursts.waits, kinds=kinds, tiers=tiers,
            pins=_pins(mgr))

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def _pins(mgr) -> dict[str, int]:
    """Pins before their deadline, in any tier (the host's share too), and pins lost before it: a
    block or state that left every tier (a running request needed the memory)."""
    now = time.monotonic()
    pools = [g.pool for g in mgr.attention_groups.values()]
    host_kv, rec = mgr.prefix_cache.host_kv, mgr.recurrent
    host = rec.host if rec is not None else None
    blocks_on_host = host_kv.pinned_entries() if host_kv is not None else 0
    states_on_host = rec.pins.live(host.entries.__contains__) if host is not None else 0
    return {"turns": mgr.prefix_cache.pinned_turns,
            "blocks": sum(1 for p in pools for t in p.pinned_until.values() if t > now) + blocks_on_host,
            "states": rec.pins.live(rec.checkpoints.__contains__) + states_on_host if rec is not None else 0,
            "blocks_on_host": blocks_on_host, "states_on_host": states_on_host,
            "reclaimed_blocks": sum(p.pins_reclaimed for p in pools) + (host_kv.pins_reclaimed if host_kv else 0),
            "reclaimed_states": rec.pins.reclaimed if rec is not None else 0}
