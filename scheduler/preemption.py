"""Which way to preempt a victim: swap its memory to the host or drop it and recompute later.

The cost model (docs/design.md, "Preemption, swap and migration"): moving costs `bytes / host bandwidth x 2` (out and back in);
recomputing costs `tokens to recompute x prefill seconds per token`, where a recompute resumes
from the request's latest block-boundary checkpoint (it is donated to the prefix cache).
Both rates are measured at start-up by `profiler.profile_model`.
"""
from __future__ import annotations

from hybridkv.specs import AttentionSpec, RecurrentSpec

from .profiler import Profile


class PreemptionPolicy:
    """mode 'recompute' | 'swap' | 'auto'; `choose(...)` gives the mode for one victim."""

    def __init__(self, mode: str, specs: dict, block_size: int, profile: Profile | None,
                 prefix_caching: bool):
        self.mode = mode
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.profile = profile
        self.block_bytes = block_size * sum(s.bytes_per_token() for s in specs.values()
                                            if isinstance(s, AttentionSpec))
        self.slot_bytes = sum(s.bytes_per_slot() for s in specs.values() if isinstance(s, RecurrentSpec))
        self.has_recurrent = self.slot_bytes > 0

    def costs(self, num_computed: int) -> tuple[float, float]:
        """(swap seconds, recompute seconds) for a victim with `num_computed` tokens."""
        p = self.profile
        blocks = -(-num_computed // self.block_size)
        swap = 2.0 * (blocks * self.block_bytes + self.slot_bytes) / p.host_bytes_per_second
        kept = num_computed // self.block_size * self.block_size if self.prefix_caching else 0
        recompute = (num_computed - kept) * p.prefill_seconds_per_token
        return swap, recompute

    def choose(self, num_computed: int) -> str:
        if self.mode != "auto":
            return self.mode
        swap, recompute = self.costs(num_computed)
        return "swap" if swap < recompute else "recompute"
