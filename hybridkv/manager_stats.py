"""The memory manager's counters, as the engine's `stats()` reports them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ManagerStats:
    """kv_blocks_*: used (refcount > 0), cached (free but still findable by hash), free, total.
    slots_*: live (one per running request), checkpoint, free, total (null slot excluded).
    prefix_*: tokens served from cache, tokens looked up, lookups; misses by reason
    ('no_kv_match', 'kv_match_no_checkpoint', 'caching_off').
    preemptions: by mode ('recompute', 'swap').
    fragmentation: unused token slots in requests' partially filled last blocks / token slots in used blocks.
    The kv_* and slots_* fields sum the attention kind and the recurrent kind; `kinds` has each one.
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

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
