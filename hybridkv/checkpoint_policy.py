"""Which recurrent states the prefix cache keeps: where a checkpoint is due, as a block boundary.

A recurrent state exists only after a whole prefix, so a checkpoint at position p needs the
prefill to stop exactly at p. The policy names p; the scheduler cuts its chunk there and calls
`PrefixCache.checkpoint` (prefix_cache.py) once the chunk is committed.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

POLICIES = ("none", "prompt_end", "every_n_blocks", "branch_points", "junctions")
DEFAULT_POLICY = "junctions"  # what LLM, EngineConfig and the manager use when none is named
# states a fresh prompt leaves along its way under 'junctions' when a host tier can hold them
# (BENCHMARKS.md, "Memory tiers": 3 meets the goal where 1 and 2 do not; more thrash a small tier)
HOST_TIER_TRAIL = 3


class CheckpointPolicy:
    """none | prompt_end | every_n_blocks (every `every_n` blocks) | branch_points | junctions.

    prompt_end: the last block boundary strictly inside the prompt, `((P - 1) // bs) x bs`, which a
    repeat of the same prompt (a hit leaves one token) and any longer prompt extending it can reuse;
    and, while the request generates, the latest block boundary of its output (the manager keeps
    one such rolling checkpoint per request), so the next turn of a chat resumes past the answer.
    branch_points: prompt_end, plus the junction where a new prompt's KV match runs past its
    deepest checkpoint AND another cached block continues the match with other content (the
    prefix tree branches there), found at admission. The end of a cached sequence that a new
    prompt merely extends (the next turn of a chat) is not a junction.
    junctions (default): branch_points, but a prompt-end state only where it adds at least as
    many tokens as its parent state (where the request resumed, or a junction or burst state it
    leaves before): a fresh prompt keeps one, so a repeat of it hits; a few-shot query or a chat
    turn after a deep state does not. Such a state serves only a repeat of this very prompt, and under a tight budget it
    displaces junctions (Marconi's admission: keep states a second request is known to want).
    BENCHMARKS.md, "Prefix-cache policies", has the numbers.

    trail (junctions only; the manager sets HOST_TIER_TRAIL when it has a host tier): a fresh
    prompt (one that resumed from no state, found no junction and leads no burst) also keeps
    `trail` states evenly spaced before its prompt end. A junction is found only when a second
    request branches off, after the first has passed it; the second then resumes from the deepest
    trail state below the junction instead of from nothing. The trail's states are cheap to hold
    in a host tier (the device's eviction rule demotes them) and not worth device slots without
    one. A prompt that found a junction or leads a burst knows where its prefix is shared: its
    state there is kept, and a trail past it would hold the prompt's own tail (in a small host
    tier it displaced the trails of prompts no one had branched from yet: BENCHMARKS.md, "Memory tiers").
    """

    def __init__(self, name: str, block_size: int, every_n: int = 4, trail: int = 0):
        if name not in POLICIES:
            raise ValueError(f"checkpoint_policy={name!r}; choose one of {POLICIES}")
        if name == "every_n_blocks" and every_n < 1:
            raise ValueError(f"checkpoint_every_n={every_n} must be >= 1 block")
        self.name = name
        self.block_size = block_size
        if trail < 0:
            raise ValueError(f"trail={trail} must be >= 0 states")
        self.every_n = every_n
        self.trail = trail if name == "junctions" else 0

    @property
    def rolling_output(self) -> bool:
        """Whether states inside generated tokens are one rolling checkpoint per request."""
        return self.name in ("prompt_end", "branch_points", "junctions")

    @property
    def keeps_final_state(self) -> bool:
        """Whether a finishing or preempted request's state at a block boundary is kept."""
        return self.name != "none"

    def prompt_end(self, num_prompt_tokens: int) -> int:
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def due(self, start: int, end: int, num_prompt_tokens: int, branch_point: Optional[int],
            shared: Sequence[int] = (), resumed_from: Optional[int] = None) -> Optional[int]:
        """The first block boundary b in (start, end] where a checkpoint is wanted, else None.

        shared: boundaries where requests waiting in a burst need this request's state (the
        manager's burst rule); every policy but 'none' honours them.
        resumed_from: where the request's prefill started (its prefix hit); None: unknown, and
        'junctions' guesses from the chunk (see _keeps_prompt_end)."""
        if self.name == "none" or end <= start:
            return None
        if not shared and start >= num_prompt_tokens:  # a decode's case: no list to build
            return self._due_in_output(start, end, num_prompt_tokens, branch_point)
        found = list(shared)
        if self.rolling_output:
            e = self.prompt_end(num_prompt_tokens)
            if self.name != "junctions" or self._keeps_prompt_end(e, start, resumed_from, branch_point, shared):
                found.append(e)
            if self.trail and not resumed_from and branch_point is None and not shared and start < e:
                found.append(self._next_trail_state(start, e))  # a fresh prompt no one shares yet
            latest = end // self.block_size * self.block_size
            if latest > num_prompt_tokens:  # in generated tokens: keep the latest boundary (multi-turn)
                found.append(latest)
        if self.name in ("branch_points", "junctions") and branch_point is not None:
            found.append(branch_point)
        if self.name == "every_n_blocks":
            step = self.every_n * self.block_size
            found.append((start // step + 1) * step)
        hits = [b for b in found if start < b <= end and b > 0]
        return min(hits) if hits else None

    def _next_trail_state(self, start: int, e: int) -> int:
        """The first of the `trail` block boundaries spread evenly over (0, e) that lies past
        start (e itself when none does: the prompt end, which the rule weighs on its own)."""
        step = -(-(e // self.block_size) // (self.trail + 1)) * self.block_size
        point = (start // step + 1) * step
        return point if point < e else e

    def decodes_due(self, ends: np.ndarray) -> np.ndarray | bool:
        """due() for one-token steps past their prompts that end at the block boundaries `ends`
        (int64): an array of bools, or one bool for all. Shared boundaries and branch points lie
        inside prompts, and so does the prompt end, so only the rule's own output boundaries count."""
        if self.rolling_output:  # the latest output boundary: this one
            return True
        if self.name == "every_n_blocks":
            return ends % (self.every_n * self.block_size) == 0
        return np.zeros(len(ends), dtype=bool)

    def _due_in_output(self, start: int, end: int, num_prompt_tokens: int, branch_point: Optional[int]
                       ) -> Optional[int]:
        """due() for a chunk past the prompt with no shared boundary: the prompt end lies before
        start, so only the latest output boundary, the branch point and every n blocks count."""
        best = None
        if self.rolling_output:
            latest = end // self.block_size * self.block_size
            if latest > start:  # so past the prompt too
                best = latest
        if branch_point is not None and start < branch_point <= end and self.name in ("branch_points", "junctions"):
            if best is None or branch_point < best:
                best = branch_point
        if self.name == "every_n_blocks":
            step = self.every_n * self.block_size
            b = (start // step + 1) * step
            if b <= end and (best is None or b < best):
                best = b
        return best

    def _keeps_prompt_end(self, e: int, start: int, resumed_from: Optional[int], branch_point: Optional[int],
                          shared: Sequence[int]) -> bool:
        """Whether the prompt end e saves at least as much as its parent, the deepest state before
        it that this request resumed from or leaves (a junction or burst cut): Marconi values a
        state by what it saves over its parent."""
        if resumed_from is not None:
            parent = max([resumed_from] + [b for b in (branch_point, *shared) if b is not None and b < e])
            return e - parent >= parent
        # Unknown: a chunk that starts off a block boundary, or adds 256+ tokens, is taken for a
        # piece of a chunked fresh prefill (no hit starts there); a short aligned tail for a
        # request that resumed from a state at `start`.
        return start % self.block_size != 0 or e - start >= min(start, 256)
