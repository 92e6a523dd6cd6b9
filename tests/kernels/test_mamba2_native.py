"""The Mamba2 decode kernels in C (kernels/mamba2_native.py) against the torch references, random inputs;
the torch paths they replace (HYBRIDKV_CPU_NATIVE=0 / forced_off) against the same references."""
import pytest
import torch
import torch.nn.functional as F

from native_paths import native_or_torch
from hybridkv.kernels import native_cpu
from hybridkv.kernels.causal_conv_cpu import conv1d_update_cpu
from hybridkv.kernels.conv1d_ref import conv1d_update_ref
from hybridkv.kernels.mamba2_cpu import mamba2_state_update_cpu
from hybridkv.kernels.mamba2_native import (Mamba2MixerDecode, conv1d_update_native,
                                            mamba2_state_update_native)
from hybridkv.kernels.mamba2_ref import mamba2_state_update_ref

H, P, N, SLOTS = 4, 6, 5, 12
SLOT_ORDERS = {"ascending": [1, 2, 3, 4, 5], "shuffled": [4, 2, 5, 1, 3], "scattered": [9, 1, 6, 11, 3]}


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


path = native_or_torch("mamba2_decode")


def ssm_inputs(g, nb, groups, with_z):
    x, dt = torch.randn(nb, H, P, generator=g), torch.randn(nb, H, generator=g) * 2
    # B and C as the mixer passes them: strided column slices of one projection row
    B, C = torch.randn(nb, 3 * groups * N, generator=g)[:, groups * N:].view(nb, 2, groups, N).unbind(1)
    z = torch.randn(nb, H, P, generator=g) if with_z else None
    return x, dt, B, C, z


@pytest.mark.parametrize("order", SLOT_ORDERS)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dt_softplus, dt_limit, with_z", [(True, None, False), (True, (0.05, 1.5), True),
                                                            (False, None, True)])
def test_state_update_matches_reference_over_steps(path, order, groups, dt_softplus, dt_limit, with_z):
    g = torch.Generator().manual_seed(groups * 7 + len(order))
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5
    slots = torch.tensor(SLOT_ORDERS[order], dtype=torch.int32)
    pool = torch.randn(SLOTS, H, P, N, generator=g)
    ref_pool, got_pool = pool.clone(), pool.clone()
    for _ in range(3):  # the same slots step after step: the states carry over
        x, dt, B, C, z = ssm_inputs(g, 5, groups, with_z)
        if not dt_softplus:
            dt = dt.abs() * 0.3
        want = mamba2_state_update_ref(ref_pool, x, dt, A, B, C, D, z, dt_bias, slots, dt_softplus, dt_limit)
        got = mamba2_state_update_cpu(got_pool, x, dt, A, B, C, D, z, dt_bias, slots, dt_softplus, dt_limit)
        assert got.dtype == want.dtype and rel_err(got, want) < 1e-5
        assert rel_err(got_pool, ref_pool) < 1e-5
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(got_pool[untouched], pool[untouched])
    native = mamba2_state_update_native(got_pool.clone(), x, dt, A, B, C, D, z, dt_bias, slots)
    assert (native is None) == (path == "torch")


def test_repeated_or_bad_slots_take_the_torch_path():
    g = torch.Generator().manual_seed(1)
    x, dt, B, C, _ = ssm_inputs(g, 3, 1, False)
    A, D = -torch.rand(H, generator=g), torch.randn(H, generator=g)
    pool = torch.randn(SLOTS, H, P, N, generator=g)
    for slots in ([2, 5, 2], [1, 2, SLOTS]):
        before = pool.clone()
        assert mamba2_state_update_native(pool, x, dt, A, B, C, D, None, None,
                                          torch.tensor(slots, dtype=torch.int32)) is None
        assert torch.equal(pool, before)  # refused before writing anything
    half = pool.half()
    assert mamba2_state_update_native(half, x, dt, A, B, C, D, None, None, torch.tensor([1, 2, 3])) is None


@pytest.mark.parametrize("k", [4, 2])
@pytest.mark.parametrize("bias, act", [(True, "silu"), (False, None)])
@pytest.mark.parametrize("order", SLOT_ORDERS)
def test_conv_update_matches_reference_over_steps(path, k, bias, act, order):
    g = torch.Generator().manual_seed(k)
    dim = 11
    w = torch.randn(dim, k, generator=g)
    b = torch.randn(dim, generator=g) if bias else None
    slots = torch.tensor(SLOT_ORDERS[order], dtype=torch.int32)
    pool = torch.randn(SLOTS, dim, k - 1, generator=g)
    ref_pool, got_pool = pool.clone(), pool.clone()
    for _ in range(3):
        x = torch.randn(5, 2 * dim, generator=g)[:, dim:]  # a column slice, as the mixer passes it
        want = conv1d_update_ref(x, ref_pool, w, b, slots, act)
        got = conv1d_update_cpu(x, got_pool, w, b, slots, act)
        assert rel_err(got, want) < 1e-6 and torch.equal(got_pool, ref_pool)
    assert (conv1d_update_native(x, got_pool, w, b, slots, act) is None) == (path == "torch")


def gated_norm_ref(y, z, weight, group, eps, mode):
    """The gated RMSNorm by its formula (models/norms.py GatedRMSNorm), fp32."""
    if mode == 0:
        return y * F.silu(z)

    def norm(h):
        g = h.view(h.shape[0], -1, group)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)

    return weight * norm(y * F.silu(z)) if mode == 1 else weight * norm(y) * F.silu(z)


@pytest.mark.parametrize("groups, mode", [(1, 1), (2, 1), (2, 2), (1, 0)])
def test_mixer_decode_matches_references(groups, mode):
    """conv1d_update_ref + mamba2_state_update_ref + the gated norm's formula, three steps."""
    if native_cpu.library("mamba2_decode") is None:
        pytest.fail("kernels/native/mamba2_decode.c must build on these machines")
    g = torch.Generator().manual_seed(10 + groups + mode)
    k, HP, GN = 4, H * P, groups * N
    conv_dim = HP + 2 * GN
    w, cb = torch.randn(conv_dim, k, generator=g), torch.randn(conv_dim, generator=g)
    slots = torch.tensor([7, 2, 3, 10], dtype=torch.int32)
    conv, ssm = torch.randn(SLOTS, conv_dim, k - 1, generator=g), torch.randn(SLOTS, H, P, N, generator=g)
    A_log = torch.randn(H, generator=g) * 0.5
    A = -torch.exp(A_log)
    dt_bias, D = torch.randn(H, generator=g) * 0.5, torch.randn(H, generator=g)
    norm_w = torch.randn(HP, generator=g) if mode else None
    call = Mamba2MixerDecode(conv, ssm, H, P, groups, w, cb, A_log, dt_bias, D, norm_w, HP // groups,
                             1e-5, mode)
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    for step in range(3):
        proj = torch.randn(4, 3 + HP + conv_dim + H, generator=g)[:, 3:] * 2  # strided rows
        if step == 2:
            proj[0, :HP] = torch.tensor([100.0, -100.0, 1e4, -1e4, 0.0, 88.5] * (HP // 6))  # gates saturate
        z, xbc, dt = proj.split([HP, conv_dim, H], 1)
        xbc = conv1d_update_ref(xbc, ref_conv, w, cb, slots, "silu")
        x, B, C = xbc.split([HP, GN, GN], 1)
        y = mamba2_state_update_ref(ref_ssm, x.reshape(-1, H, P), dt, A, B.reshape(-1, groups, N),
                                    C.reshape(-1, groups, N), D, None, dt_bias, slots).reshape(-1, HP)
        want = gated_norm_ref(y, z, norm_w, HP // groups, 1e-5, mode)
        got = call(proj, slots)
        assert rel_err(got, want) < 1e-5
        assert rel_err(ssm, ref_ssm) < 1e-5 and rel_err(conv, ref_conv) < 1e-6
    before = ssm.clone()
    assert call(proj, torch.tensor([1, 2, 1, 3], dtype=torch.int32)) is None  # a repeated slot
    assert call(proj.double(), slots) is None and torch.equal(ssm, before)
    with native_cpu.forced_off():
        assert call(proj, slots) is None
