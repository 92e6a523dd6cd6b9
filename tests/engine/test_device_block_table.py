"""DeviceBlockTable: after every update the device rows equal the host table (its first W
entries), only changed rows travel, padding rows never start with -1, and a bad table is
refused before anything changes."""
import numpy as np
import pytest
import torch

from hybridkv.scheduler.device_block_table import DeviceBlockTable


def test_random_updates_match_the_host_table_and_move_only_changed_rows():
    rng = np.random.default_rng(0)
    t = DeviceBlockTable(rows=6, max_blocks=5, device="cpu")
    host = np.zeros((6, 5), dtype=np.int32)  # what a full upload would leave on the device
    for step in range(200):
        r, w = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        table = host[:r, :w].copy()
        for row in rng.choice(r, size=int(rng.integers(0, r + 1)), replace=False):
            table[row] = rng.integers(-1, 50, size=w)  # -1: a block that left a window
        want_changed = int((host[:r, :w] != table).any(axis=1).sum())
        padded = int(rng.integers(r, 7))
        moved = t.update(table, padded, non_blocking=False)
        host[:r, :w] = table
        pads_fixed = [p for p in range(r, padded) if host[p, 0] < 0]
        host[pads_fixed, 0] = 0
        assert moved == want_changed + len(pads_fixed), step
        assert np.array_equal(t.table.numpy(), host), step
        assert (t.table[r:padded, 0] >= 0).all()


def test_a_bad_table_is_refused_and_changes_nothing():
    t = DeviceBlockTable(rows=4, max_blocks=3, device="cpu")
    t.update(np.arange(6, dtype=np.int32).reshape(2, 3), 2, non_blocking=False)
    before = t.table.clone()
    for bad in (np.zeros((2, 4), dtype=np.int32), np.zeros((3, 2), dtype=np.int32),
                np.zeros(3, dtype=np.int32)):
        with pytest.raises(ValueError, match=r"block_table has shape .* expected \[2, <= 3\]"):
            t.check(bad, 2)
    assert torch.equal(t.table, before)
