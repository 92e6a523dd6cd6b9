"""A block table that lives on the device and is updated in place, one changed row at a time.

A captured decode graph reads its block table from a fixed address, so the table cannot be
rebuilt and uploaded each step. Most steps change nothing in it (a decode row changes when its
request gains a block or another request takes the row), so a host mirror of the device's rows
says which rows differ; only those travel, staged as `[row, entries...]` in one copy, and land
with one index_copy_.
"""
from __future__ import annotations

import numpy as np
import torch


class DeviceBlockTable:
    """`table`: int32 [rows, max_blocks] on `device`; `update` brings rows in line with a host
    table. `pin`: stage in pinned memory (a GPU), so the copy is asynchronous."""

    def __init__(self, rows: int, max_blocks: int, device, pin: bool = False):
        self.max_blocks = max_blocks
        self.table = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self._mirror = np.zeros((rows, max_blocks), dtype=np.int32)  # what the device holds
        self._staging = torch.zeros(rows, max_blocks + 1, dtype=torch.int32, pin_memory=pin)
        self._staged = torch.zeros(rows, max_blocks + 1, dtype=torch.int32, device=device)

    def check(self, table: np.ndarray, num_rows: int) -> None:
        """ValueError unless `table` is [num_rows, <= max_blocks] (nothing changes)."""
        if table.ndim != 2 or table.shape[0] != num_rows or table.shape[1] > self.max_blocks:
            raise ValueError(f"block_table has shape {tuple(table.shape)}; expected [{num_rows}, <= "
                             f"{self.max_blocks}] (max_model_len / block_size)")

    def update(self, table: np.ndarray, padded_rows: int, non_blocking: bool) -> int:
        """Make device rows 0..R-1 equal `table` [R, W] in their first W entries, and give rows
        R..padded_rows-1 (padding) a valid first entry (a stale -1, a block that left a window,
        becomes 0). Returns how many rows travelled."""
        r, width = table.shape
        mirror = self._mirror
        rows = np.flatnonzero((mirror[:r, :width] != table).any(axis=1)).tolist()
        mirror[rows, :width] = table[rows]
        pads = [p for p in range(r, padded_rows) if mirror[p, 0] < 0]
        mirror[pads, 0] = 0
        changed = rows + pads
        if not changed:
            return 0
        staging = self._staging.numpy()
        staging[:len(changed), 0] = changed
        staging[:len(changed), 1:] = mirror[changed]
        k = len(changed)
        self._staged[:k].copy_(self._staging[:k], non_blocking=non_blocking)
        self.table.index_copy_(0, self._staged[:k, 0].long(), self._staged[:k, 1:])
        return k
