"""The Mamba2 decode over quantized state pools (ops.mamba2_mixer_decode_q: each slot's codes decoded,
stepped and encoded back in one C pass) against the torch reference of the same arithmetic: the
slots decoded by the layout's torch path, the float decode (the torch references; and, value for
value, the float C kernel), the slots encoded by the torch path after. Random inputs of many
magnitudes, a NaN row, int8 and fp8, rows of 32 (the encode's copy for them) and of 16."""
import pytest
import torch
import torch.nn.functional as F

from hybridkv.cache_dtype import conv_layout, state_layout
from hybridkv.kernels import native_cpu, ops
from hybridkv.kernels.conv1d_ref import conv1d_update_ref
from hybridkv.kernels.mamba2_native import Mamba2MixerDecode
from hybridkv.kernels.mamba2_ref import mamba2_state_update_ref

H, P, SLOTS, K = 4, 6, 9, 4


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def gated_norm_ref(y, z, weight, group, eps, mode):
    """The gated RMSNorm by its formula (models/norms.py GatedRMSNorm), fp32 (as test_mamba2_native)."""
    if mode == 0:
        return y * F.silu(z)

    def norm(h):
        g = h.view(h.shape[0], -1, group)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)

    return weight * norm(y * F.silu(z)) if mode == 1 else weight * norm(y) * F.silu(z)


def nan_equal(a, b) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("N, groups, mode", [(32, 1, 1), (16, 2, 2), (32, 2, 0)])
def test_quantized_mixer_decode_matches_the_reference(dtype, N, groups, mode):
    if native_cpu.library("mamba2_decode") is None:
        pytest.fail("kernels/native/mamba2_decode.c must build on these machines")
    g = torch.Generator().manual_seed(N + groups + mode + len(dtype))
    HP, GN = H * P, groups * N
    conv_dim = HP + 2 * GN
    cl, sl = conv_layout(dtype, (conv_dim, K - 1)), state_layout(dtype, (H, P, N))
    w, cb = torch.randn(conv_dim, K, generator=g), torch.randn(conv_dim, generator=g)
    A_log = torch.randn(H, generator=g) * 0.5
    A = -torch.exp(A_log)
    dt_bias, D = torch.randn(H, generator=g) * 0.5, torch.randn(H, generator=g)
    norm_w = torch.randn(HP, generator=g) if mode else None
    conv_vals = torch.randn(SLOTS, conv_dim, K - 1, generator=g) * torch.exp(
        torch.empty(SLOTS, 1, K - 1).uniform_(-4, 4, generator=g))
    ssm_vals = torch.randn(SLOTS, H, P, N, generator=g) * torch.exp(
        torch.empty(SLOTS, H, P, 1).uniform_(-6, 6, generator=g))
    ssm_vals[5, 1, 2, 3] = float("nan")  # one row of slot 5 decodes to NaN
    conv_q, ssm_q = cl.encode(conv_vals), sl.encode(ssm_vals)
    slots = torch.tensor([7, 0, 5, 2], dtype=torch.int32)  # slot 0, the null slot, is never written back
    written = torch.tensor([7, 5, 2])
    cache = {}
    for step in range(3):
        proj = torch.randn(4, 3 + HP + conv_dim + H, generator=g)[:, 3:] * 2  # strided rows
        # the reference: decode (torch), the float decode, encode (torch) the written slots
        conv_f, ssm_f = cl.decode(conv_q), sl.decode(ssm_q)
        float_conv, float_ssm = conv_f.clone(), ssm_f.clone()
        z, xbc, dt = proj.split([HP, conv_dim, H], 1)
        xbc = conv1d_update_ref(xbc, conv_f, w, cb, slots, "silu")
        x, B, C = xbc.split([HP, GN, GN], 1)
        y = mamba2_state_update_ref(ssm_f, x.reshape(-1, H, P), dt, A, B.reshape(-1, groups, N),
                                    C.reshape(-1, groups, N), D, None, dt_bias, slots).reshape(-1, HP)
        want = gated_norm_ref(y, z, norm_w, HP // groups, 1e-5, mode)
        same = Mamba2MixerDecode(float_conv, float_ssm, H, P, groups, w, cb, A_log, dt_bias, D, norm_w,
                                 HP // groups, 1e-5, mode)(proj, slots)  # the float C kernel
        want_conv, want_ssm = conv_q.clone(), ssm_q.clone()
        want_conv[written], want_ssm[written] = cl.encode(float_conv[written]), sl.encode(float_ssm[written])

        got = ops.mamba2_mixer_decode_q(
            proj, slots, conv_pool=conv_q, conv_layout=cl, ssm_pool=ssm_q, ssm_layout=sl, num_heads=H, head_dim=P,
            n_groups=groups, conv_weight=w, conv_bias=cb, A_log=A_log, dt_bias=dt_bias, D=D, norm_weight=norm_w,
            norm_group=HP // groups, eps=1e-5, norm_mode=mode, cache=cache)
        assert got is not None
        assert nan_equal(got, same)  # value for value
        finite = ~want.isnan().any(1)
        assert torch.equal(finite, ~got.isnan().any(1)) and not finite[2]  # slot 5's request: NaN
        assert rel_err(got[finite], want[finite]) < 1e-5
        assert torch.equal(conv_q, want_conv)
        ok = torch.tensor([s != 5 for s in range(SLOTS)])  # slot 5's NaN row: codes differ, values do not
        assert torch.equal(ssm_q[ok], want_ssm[ok]) and nan_equal(sl.decode(ssm_q[5]), sl.decode(want_ssm[5]))
    assert len(cache) and cache["call_q"] is not None


def test_it_writes_nothing_where_it_cannot_run():
    """Repeated slots, non-uint8 pools or native kernels off: None, and the pools are untouched."""
    cl, sl = conv_layout("int8", (H * P + 2 * 8, K - 1)), state_layout("int8", (H, P, 8))
    g = torch.Generator().manual_seed(3)
    conv_q = cl.encode(torch.randn(SLOTS, *cl.shape, generator=g))
    ssm_q = sl.encode(torch.randn(SLOTS, *sl.shape, generator=g))
    before = (conv_q.clone(), ssm_q.clone())
    conv_dim = H * P + 16
    kw = dict(conv_layout=cl, ssm_layout=sl, num_heads=H, head_dim=P, n_groups=1,
              conv_weight=torch.randn(conv_dim, K), conv_bias=None, A_log=torch.zeros(H), dt_bias=None,
              D=None, norm_weight=None, norm_group=H * P, eps=0.0, norm_mode=0)
    proj = torch.randn(2, H * P + conv_dim + H)
    assert ops.mamba2_mixer_decode_q(proj, torch.tensor([3, 3], dtype=torch.int32), conv_pool=conv_q,
                                     ssm_pool=ssm_q, cache={}, **kw) is None
    assert ops.mamba2_mixer_decode_q(proj, torch.tensor([3, 4], dtype=torch.int32), conv_pool=conv_q.float(),
                                     ssm_pool=ssm_q, cache={}, **kw) is None
    with native_cpu.forced_off():
        assert ops.mamba2_mixer_decode_q(proj, torch.tensor([3, 4], dtype=torch.int32), conv_pool=conv_q,
                                         ssm_pool=ssm_q, cache={}, **kw) is None
    assert torch.equal(conv_q, before[0]) and torch.equal(ssm_q, before[1])
    assert ops.mamba2_mixer_decode_q(proj, torch.tensor([3, 4], dtype=torch.int32), conv_pool=conv_q,
                                     ssm_pool=ssm_q, cache={}, **kw) is not None
    assert not torch.equal(ssm_q, before[1])
