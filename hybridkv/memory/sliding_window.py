"""Sliding-window KV: full-attention paging whose blocks are let go once they leave the window.

With window w, the token at position p attends to keys (p - w, p]. After each step, blocks
wholly before the next token's window are released: they keep their hash and stay findable
(LRU) like any freed block, so a long generation holds at most ceil(w / block_size) + 1 blocks.
A prefix hit at p needs only the blocks of [p - w + 1, p) to be cached, not the whole prefix.
"""
from __future__ import annotations

from typing import Hashable, Mapping, Optional, Sequence

import numpy as np
import torch

from hybridkv.specs import AttentionSpec

from .full_attention import NO_BLOCK, FullAttentionMemory


class SlidingWindowMemory(FullAttentionMemory):
    """Paged KV of layers that share one sliding window of `window` tokens."""

    @staticmethod
    def handles(spec) -> bool:
        return isinstance(spec, AttentionSpec) and spec.sliding_window is not None

    def __init__(self, layers: Mapping[int, AttentionSpec], block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu", max_chunk_tokens: Optional[int] = None):
        windows = {s.sliding_window for s in layers.values()}
        if len(windows) != 1:
            raise ValueError(f"one SlidingWindowMemory serves one window size; layers have {sorted(windows)}")
        self.window = windows.pop()
        if self.window < 1:
            raise ValueError(f"sliding_window={self.window} must be >= 1 token")
        self.name = f"sliding_window_{self.window}"
        self.max_chunk_tokens = max_chunk_tokens
        self._let_go: dict[Hashable, int] = {}  # rid -> table positions before it are all let go
        super().__init__(layers, block_size, num_blocks, device)

    def release(self, rid: Hashable, donate: Optional[tuple[bytes, int]] = None) -> None:
        self._let_go.pop(rid, None)
        super().release(rid, donate)

    def first_needed_token(self, position: int) -> int:
        return max(0, position - self.window + 1)

    def _blocks_to_hold(self, num_tokens: int) -> int:
        # a prefill chunk of C tokens holds the window before it plus its own blocks
        chunk = min(num_tokens, self.max_chunk_tokens or num_tokens)
        return min(-(-num_tokens // self.block_size), -(-(self.window - 1 + chunk) // self.block_size) + 1)

    def usable_prefix(self, hashes: Sequence[bytes], limit: int) -> int:
        limit = min(limit, len(hashes))
        cached = self.pool.cached
        run, runs = 0, []
        for h in hashes[:limit]:  # runs[i]: cached blocks in a row ending at block i
            run = run + 1 if h in cached else 0
            runs.append(run)
        for m in range(limit, 0, -1):
            if runs[m - 1] >= m - self.first_needed_block(m * self.block_size):
                return m
        return 0

    def _let_go_before(self, num_computed):
        """Table positions before it leave the window once num_computed tokens are computed (the
        block holding token num_computed - 1 stays: a checkpoint at num_computed re-registers it);
        an int or an int64 array."""
        first = np.maximum(0, num_computed - self.window + 1) // self.block_size
        return np.minimum(first, np.maximum(0, (num_computed - 1) // self.block_size))

    decode_commit_always_idle = False

    def decode_commit_idle(self, num_computed: np.ndarray) -> np.ndarray:
        # idle unless this token moves a block out of the window (the previous commit let go the rest)
        return self._let_go_before(num_computed) == self._let_go_before(num_computed - 1)

    def commit(self, rid: Hashable, hashes: Sequence[bytes], num_hashed: int, num_full: int,
               num_computed: int) -> None:
        super().commit(rid, hashes, num_hashed, num_full, num_computed)  # hash first: freed blocks stay findable
        blocks = self._blocks[rid]
        gone = int(self._let_go_before(num_computed))
        start = self._let_go.get(rid, 0)  # positions before it were let go already: O(new) per step
        self._let_go[rid] = max(start, gone)
        out = [i for i in range(start, gone) if blocks[i] != NO_BLOCK]
        if out:
            self.pool.release([blocks[i] for i in out])
            for i in out:
                blocks[i] = NO_BLOCK
            self.tables.array[self._row[rid], out] = 0  # let-go positions read block 0, masked
