"""The Mamba1 and gated-delta-rule decode steps in C (kernels/recurrent_native.py) against the torch
references on random inputs, over several steps and slot orders; the torch paths they replace
(native kernels forced off) against the same references."""
import pytest
import torch

from native_paths import native_or_torch
from hybridkv.kernels.gdn_cpu import gdn_state_update_cpu
from hybridkv.kernels.gdn_ref import gdn_state_update_ref
from hybridkv.kernels.mamba1_cpu import mamba1_state_update_cpu
from hybridkv.kernels.mamba1_ref import mamba1_state_update_ref
from hybridkv.kernels.recurrent_native import gdn_state_update_native, mamba1_state_update_native

SLOTS = 12
SLOT_ORDERS = {"ascending": [1, 2, 3, 4, 5], "shuffled": [4, 2, 5, 1, 3], "scattered": [9, 1, 6, 11, 3]}


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


path = native_or_torch("mamba1_decode", "gdn_decode")


@pytest.mark.parametrize("order", SLOT_ORDERS)
@pytest.mark.parametrize("dt_softplus, with_z, with_d", [(True, True, True), (False, False, False)])
def test_mamba1_matches_reference_over_steps(path, order, dt_softplus, with_z, with_d):
    g = torch.Generator().manual_seed(len(order) + dt_softplus)
    d, N, nb = 10, 6, 5
    A = -torch.exp(torch.randn(d, N, generator=g))
    D = torch.randn(d, generator=g) if with_d else None
    dt_bias = torch.randn(d, generator=g) * 0.5
    slots = torch.tensor(SLOT_ORDERS[order], dtype=torch.int32)
    pool = torch.randn(SLOTS, d, N, generator=g)
    ref_pool, got_pool = pool.clone(), pool.clone()
    for _ in range(3):
        xz = torch.randn(nb, 2 * d, generator=g)  # x and z: column slices of one projection
        x, z = xz[:, :d], (xz[:, d:] if with_z else None)
        dt = torch.randn(nb, d, generator=g) * (1 if dt_softplus else 0.3)
        dt = dt if dt_softplus else dt.abs()
        B, C = torch.randn(nb, N, generator=g), torch.randn(nb, N, generator=g)
        want = mamba1_state_update_ref(ref_pool, x, dt, A, B, C, D, z, dt_bias, slots, dt_softplus)
        got = mamba1_state_update_cpu(got_pool, x, dt, A, B, C, D, z, dt_bias, slots, dt_softplus)
        assert rel_err(got, want) < 1e-5 and rel_err(got_pool, ref_pool) < 1e-5
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(got_pool[untouched], pool[untouched])
    ran = mamba1_state_update_native(got_pool, x, dt, A, B, C, D, z, dt_bias, slots, dt_softplus)
    assert (ran is None) == (path == "torch")


@pytest.mark.parametrize("order", SLOT_ORDERS)
@pytest.mark.parametrize("heads, v_heads", [(2, 2), (1, 3)])
def test_gdn_matches_reference_over_steps(path, order, heads, v_heads):
    g = torch.Generator().manual_seed(len(order) + heads)
    K, V, nb = 8, 6, 5
    slots = torch.tensor(SLOT_ORDERS[order], dtype=torch.int32)
    pool = torch.randn(SLOTS, v_heads, K, V, generator=g)
    ref_pool, got_pool = pool.clone(), pool.clone()
    for _ in range(3):
        q, k = torch.randn(nb, heads, K, generator=g), torch.randn(nb, heads, K, generator=g)
        # v as strided rows (a column slice of a projection)
        v = torch.randn(nb, 2 * v_heads * V, generator=g)[:, v_heads * V:].view(nb, v_heads, V)
        gate = -torch.rand(nb, v_heads, generator=g) * 2
        beta = torch.rand(nb, v_heads, generator=g)
        want = gdn_state_update_ref(ref_pool, q, k, v, gate, beta, slots)
        got = gdn_state_update_cpu(got_pool, q, k, v, gate, beta, slots)
        assert rel_err(got, want) < 1e-5 and rel_err(got_pool, ref_pool) < 1e-5
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(got_pool[untouched], pool[untouched])
    qf = torch.nn.functional.normalize(q, dim=-1).repeat_interleave(v_heads // heads, 1)
    ran = gdn_state_update_native(got_pool, qf, qf, v, gate, beta, slots)
    assert (ran is None) == (path == "torch")


def test_repeated_or_bad_slots_take_the_torch_path():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(SLOTS, 2, 4, 3, generator=g)
    before = pool.clone()
    qf, v = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 3, generator=g)
    gate, beta = -torch.rand(3, 2, generator=g), torch.rand(3, 2, generator=g)
    for slots in ([2, 5, 2], [1, 2, SLOTS]):
        assert gdn_state_update_native(pool, qf, qf, v, gate, beta, torch.tensor(slots)) is None
    m_pool = torch.randn(SLOTS, 4, 3, generator=g)
    m_before = m_pool.clone()
    x = torch.randn(3, 4, generator=g)
    B = torch.randn(3, 3, generator=g)
    assert mamba1_state_update_native(m_pool, x, x, -torch.rand(4, 3), B, B, None, None, None,
                                      torch.tensor([3, 3, 1])) is None
    assert torch.equal(pool, before) and torch.equal(m_pool, m_before)  # refused before any write
