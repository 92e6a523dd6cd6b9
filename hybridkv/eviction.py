"""Which state checkpoint to evict when the slots run out.

`choose_victim` ranks the candidate checkpoints (least recently used first) by the rule named in
`checkpoint_eviction`:

- 'lru': the least recently used.
- 'flop': recency + prefill FLOPs saved per byte of state (Marconi's utility without its tree).
- 'utility' (DEFAULT_EVICTION): Marconi's utility with the prefix tree's shape. Score, higher kept:
      i / (n - 1)                 recency rank (0 = least recently used)
    + F(p_i) / max_j F(p_j)       prefill FLOPs the state saves, per byte (every slot has the same
                                  size, so per slot); F = saved_flops
    + 2 if branches_i >= 2        a junction: several cached continuations share this prefix, so
                                  future requests of every branch resume here
    - 1 if branches_i == 1        some request already ran past this state and left a deeper one
                                  (the previous turn of a chat, a state inside a prompt)
  A leaf (branches 0: a state nothing has extended yet, e.g. a chat's last answer) gets neither.
  Without `branches` the tree terms are 0 and the rule is 'flop'.
Why these weights: BENCHMARKS.md, "Prefix-cache policies" (the ranking holds for a junction bonus
of 1-2 and a FLOP weight of 1-2; dropping either term loses most hits at 4 slots).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

EVICTION_RULES = ("lru", "flop", "utility")
DEFAULT_EVICTION = "utility"
JUNCTION_BONUS = 2.0
PASSED_PENALTY = 1.0


def check_rule(rule: str) -> None:
    if rule not in EVICTION_RULES:
        raise ValueError(f"checkpoint_eviction={rule!r}; choose one of {EVICTION_RULES}")


def choose_victim(rule: str, positions: Sequence[int], saved_flops: Callable[[int], float],
                  flop_weight: float = 1.0, *, branches: Optional[Sequence[int]] = None,
                  passed_penalty: float = PASSED_PENALTY) -> int:
    """Index into the candidates of the checkpoint to evict.

    positions: [n] token position of each candidate checkpoint, least recently used first.
    saved_flops(p): prefill FLOPs a hit at position p saves.
    branches: [n] optional, per candidate the number of distinct cached blocks that continue its
        prefix (the prefix tree's out-degree at the checkpoint); used by 'utility'.
    passed_penalty: what 'utility' takes off a state some request ran past (the host tier's is 0:
        memory/host_tier.py)."""
    if rule == "lru" or len(positions) == 1:
        return 0
    flops = [saved_flops(p) for p in positions]
    top = max(flops) or 1.0
    n = len(positions) - 1
    tree = [0.0] * len(positions)
    if rule == "utility" and branches is not None:
        tree = [JUNCTION_BONUS if b >= 2 else -passed_penalty if b == 1 else 0.0 for b in branches]
    scores = [i / n + flop_weight * f / top + t for i, (f, t) in enumerate(zip(flops, tree))]
    return min(range(len(positions)), key=scores.__getitem__)
