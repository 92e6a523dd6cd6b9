"""slot_rows: which decode batches update their states in place, over which runs of slots."""
import torch

from hybridkv.kernels.slot_rows import slot_runs, update_slot_rows


def runs_of(ids, num_slots=64, **kw):
    runs, order = slot_runs(torch.zeros(num_slots, 3), torch.tensor(ids), **kw)
    return runs, None if order is None else order.tolist()


def test_runs_and_order():
    assert runs_of([1, 2, 3]) == ([(1, 0, 3)], None)
    assert runs_of([4, 2, 3]) == ([(2, 0, 3)], [1, 2, 0])
    ids = list(range(1, 20)) + list(range(38, 50)) + [62]  # a batch seen in the Bamba workload
    assert runs_of(ids) == ([(1, 0, 19), (38, 19, 31), (62, 31, 32)], None)


def test_gathers_when_too_scattered_repeated_or_strided():
    assert runs_of([1, 3, 5, 7]) == (None, None)  # 4 runs of 1 > 4 // 2
    assert runs_of([1, 3, 5, 7], max_runs=4)[0] == [(1, 0, 1), (3, 1, 2), (5, 2, 3), (7, 3, 4)]
    assert runs_of([2, 3, 3]) == (None, None)
    assert slot_runs(torch.zeros(3, 8)[:, ::2], torch.tensor([0, 1])) == (None, None)


def test_update_in_place_matches_gather():
    gen = torch.Generator().manual_seed(0)
    for ids in ([5, 1, 2, 6, 3], [9, 1, 5, 3, 7]):  # two runs (in place) / scattered (gather)
        pool = torch.randn(10, 4, generator=gen)
        x = torch.randn(5, 4, generator=gen)
        want_pool = pool.clone()
        slots = torch.tensor(ids)
        want_out = want_pool[slots] * 2 + x
        want_pool[slots] = want_out

        def update(rows, xr):
            rows.mul_(2).add_(xr)
            return rows.clone()

        out = update_slot_rows(pool, slots, (x,), update)
        assert torch.equal(out, want_out) and torch.equal(pool, want_pool)
