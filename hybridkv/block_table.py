"""CPU block tables, one row per request with blocks, updated in place as blocks are added.

A step's `[R, max_blocks]` table is one numpy gather of the rows, not a rebuild from lists.
"""
from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    """An int32 array `[rows, cols]` that grows by doubling; row r holds one request's block ids."""

    def __init__(self, rows: int = 64, cols: int = 64):
        self.array = np.zeros((rows, cols), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

    def new_row(self) -> int:
        if not self._free_rows:
            rows = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)], axis=0)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def ensure_cols(self, end: int) -> None:
        """Make columns [0, end) exist (doubling the width)."""
        cols = self.array.shape[1]
        if end > cols:
            while cols < end:
                cols *= 2
            grown = np.zeros((self.array.shape[0], cols), dtype=np.int32)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Set columns [start, start + len(blocks)) of `row`."""
        end = start + len(blocks)
        self.ensure_cols(end)
        if len(blocks) == 1:
            self.array[row, start] = blocks[0]
        else:
            self.array[row, start:end] = blocks

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """`[len(rows), width]` int32 CPU tensor; entries past a request's blocks are stale (unused)."""
        width = max(1, width)
        if width > self.array.shape[1]:
            out = np.zeros((len(rows), width), dtype=np.int32)
            out[:, : self.array.shape[1]] = self.array[rows]
            return torch.from_numpy(out)
        return torch.from_numpy(self.array[rows, :width])
