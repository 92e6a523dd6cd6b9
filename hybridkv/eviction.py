"""Which state checkpoint to evict when the slots run out.

`choose_victim` ranks candidate checkpoints (oldest use first) by the rule named in
`checkpoint_eviction`: 'lru' takes the least recently used; 'flop' keeps the ones that save the
most prefill FLOPs per byte of state, weighed with recency (Marconi's utility).
"""
from __future__ import annotations

from typing import Callable, Sequence

EVICTION_RULES = ("lru", "flop")


def check_rule(rule: str) -> None:
    if rule not in EVICTION_RULES:
        raise ValueError(f"checkpoint_eviction={rule!r}; choose one of {EVICTION_RULES}")


def choose_victim(rule: str, positions: Sequence[int], saved_flops: Callable[[int], float],
                  flop_weight: float = 1.0) -> int:
    """Index into `positions` (checkpoint positions in tokens, least recently used first) of the
    checkpoint to evict."""
    if rule == "lru" or len(positions) == 1:
        return 0
    # normalised recency + weight x normalised FLOPs saved per state byte (every slot has the same
    # size, so FLOPs saved ranks the same as FLOPs per byte)
    flops = [saved_flops(p) for p in positions]
    top = max(flops) or 1.0
    n = len(positions) - 1
    scores = [i / n + flop_weight * f / top for i, f in enumerate(flops)]
    return min(range(len(positions)), key=scores.__getitem__)
