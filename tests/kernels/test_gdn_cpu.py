"""The in-place CPU gated-delta-rule decode step (kernels/gdn_cpu.py) against the reference."""
import pytest
import torch

import hybridkv.kernels as K
from hybridkv.kernels.gdn_cpu import gdn_state_update_cpu
from hybridkv.kernels.gdn_ref import gdn_state_update_ref
from state_kernel_helpers import rel_err

H, HV, KD, VD, SLOTS, NB = 2, 4, 6, 5, 10, 5
SLOT_LAYOUTS = {  # scattered: gather + write back; a range (sorted or not): a view of the pool
    "scattered": lambda g: torch.randperm(SLOTS - 1, generator=g)[:NB] + 1,
    "range": lambda g: torch.arange(2, 2 + NB),
    "range_shuffled": lambda g: torch.randperm(NB, generator=g) + 3,
    "range_with_hole": lambda g: torch.tensor([7, 2, 3, 5, 6]),
}


def inputs(g, nb=NB):
    q, k = torch.randn(2, nb, H, KD, generator=g)
    v = torch.randn(nb, HV, VD, generator=g)
    gate = -torch.rand(nb, HV, generator=g) * 2
    beta = torch.rand(nb, HV, generator=g) * 0.9 + 0.05
    return q, k, v, gate, beta


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("l2norm,scale", [(True, None), (False, 0.3)])
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
def test_state_update_matches_reference(pool_dtype, l2norm, scale, layout):
    g = torch.Generator().manual_seed(6)
    q, k, v, gate, beta = inputs(g)
    slots = SLOT_LAYOUTS[layout](g).to(torch.int32)
    pool = torch.randn(SLOTS, HV, KD, VD, generator=g).to(pool_dtype)
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    want = gdn_state_update_ref(ref_pool, q, k, v, gate, beta, slots, scale, l2norm)
    got = gdn_state_update_cpu(cpu_pool, q, k, v, gate, beta, slots, scale, l2norm)
    tol = 1e-5 if pool_dtype == torch.float32 else 2e-3
    assert rel_err(got, want) < tol and rel_err(cpu_pool, ref_pool) < tol
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(cpu_pool[untouched], pool[untouched])


def test_value_heads_not_a_multiple_are_refused_before_any_write():
    g = torch.Generator().manual_seed(2)
    q, k, v, gate, beta = inputs(g)
    pool = torch.randn(SLOTS, 3, KD, VD, generator=g)
    before = pool.clone()
    with pytest.raises(ValueError, match="3 value heads cannot share 2"):
        gdn_state_update_cpu(pool, q, k, v[:, :3], gate[:, :3], beta[:, :3],
                             torch.arange(1, 1 + NB, dtype=torch.int32))
    assert torch.equal(pool, before)


def test_dispatch_routes_cpu_here(monkeypatch):
    monkeypatch.delenv("HYBRIDKV_BACKEND", raising=False)
    import hybridkv.kernels.gdn_cpu as mod

    calls = []
    monkeypatch.setattr(mod, "gdn_state_update_cpu", lambda *a: calls.append(1) or gdn_state_update_cpu(*a))
    g = torch.Generator().manual_seed(3)
    q, k, v, gate, beta = inputs(g, 2)
    pool = torch.randn(SLOTS, HV, KD, VD, generator=g)
    slots = torch.tensor([4, 1], dtype=torch.int32)
    want = gdn_state_update_ref(pool.clone(), q, k, v, gate, beta, slots)
    assert rel_err(K.gdn_state_update(pool, q, k, v, gate, beta, slots), want) < 1e-5 and calls == [1]


def prefill_case(lengths, init, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, gate, beta = inputs(g, sum(lengths))
    pool = torch.randn(SLOTS, HV, KD, VD, generator=g)
    slots = (torch.randperm(SLOTS - 1, generator=g)[:len(lengths)] + 1).to(torch.int32)
    pool[slots[~torch.tensor(init)].long()] = float("nan")  # never read without an initial state
    qsl = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return (q, k, v, gate, beta), pool, qsl, slots, torch.tensor(init)


@pytest.mark.parametrize("chunk_size", [4, 8])
@pytest.mark.parametrize("l2norm,scale", [(True, None), (False, 0.3)])
def test_chunk_scan_matches_reference(chunk_size, l2norm, scale):
    """Ragged requests (1, chunk - 1, chunk, chunk + 1, several chunks), fresh and continued,
    with states asked mid-chunk, at chunk ends, at the first and the last token, and not at all."""
    from hybridkv.kernels.gdn_cpu import gdn_chunk_scan_cpu
    from hybridkv.kernels.gdn_ref import gdn_chunk_scan_ref

    lengths = [1, chunk_size - 1, chunk_size, chunk_size + 1, 3 * chunk_size + 2]
    init = [True, False, True, False, True]
    args, pool, qsl, slots, has_init = prefill_case(lengths, init, seed=chunk_size)
    at = [[1], [2, chunk_size - 1], [], [chunk_size, chunk_size + 1], [1, chunk_size + 3, 3 * chunk_size + 2]]
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    kw = dict(scale=scale, use_qk_l2norm=l2norm, chunk_size=chunk_size, return_states_at=at)
    want, want_s = gdn_chunk_scan_ref(ref_pool, *args, qsl, slots, has_init, **kw)
    got, got_s = gdn_chunk_scan_cpu(cpu_pool, *args, qsl, slots, has_init, **kw)
    assert rel_err(got, want) < 1e-5
    assert [tuple(s.shape) for s in got_s] == [tuple(s.shape) for s in want_s]
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(got_s, want_s) if b.numel())
    touched = slots.long()
    assert rel_err(cpu_pool[touched], ref_pool[touched]) < 1e-5
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[touched] = False
    assert torch.equal(cpu_pool[others], pool[others])
    # without positions: the same outputs and final states
    again = pool.clone()
    plain = gdn_chunk_scan_cpu(again, *args, qsl, slots, has_init, scale=scale, use_qk_l2norm=l2norm,
                               chunk_size=chunk_size)
    assert torch.equal(plain, got) and rel_err(again[touched], ref_pool[touched]) < 1e-5


def test_chunk_scan_bad_position_changes_nothing_and_dispatch(monkeypatch):
    monkeypatch.delenv("HYBRIDKV_BACKEND", raising=False)
    import hybridkv.kernels.gdn_cpu as mod

    args, pool, qsl, slots, has_init = prefill_case([5, 3], [True, True], seed=1)
    before = pool.clone()
    with pytest.raises(ValueError, match="position 4 of request 1 is outside 1..3"):
        mod.gdn_chunk_scan_cpu(pool, *args, qsl, slots, has_init, return_states_at=[[5], [4]])
    assert torch.equal(pool, before)
    calls = []
    real = mod.gdn_chunk_scan_cpu
    monkeypatch.setattr(mod, "gdn_chunk_scan_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    K.gdn_chunk_scan(pool, *args, qsl, slots, has_init, chunk_size=4)
    assert calls == [1]
