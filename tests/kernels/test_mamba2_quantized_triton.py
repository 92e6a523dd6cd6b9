"""The Triton Mamba2 decode over quantized state pools (kernels/mamba2_quantized_triton.py), interpreted:
against the float Triton path on the slots decoded by the layout's torch path and encoded by it after
(conv1d_update_triton, mamba2_state_update_triton: the same arithmetic, so the same bytes and values),
and against the torch references (within fp32 tolerance). Random inputs of many magnitudes, shuffled
slots with the null slot among them, a NaN row, int8 and fp8, conv widths 4, 3 and 2, windows walked
in one block of channels and in several. Tiny shapes: the interpreter is slow."""
import pytest
import torch

from hybridkv.cache_dtype import conv_layout, state_layout
from hybridkv.kernels import mamba2_quantized_triton as mq
from hybridkv.kernels import ops
from hybridkv.kernels.conv1d import conv1d_update_triton
from hybridkv.kernels.conv1d_ref import conv1d_update_ref
from hybridkv.kernels.mamba2 import mamba2_state_update_triton
from hybridkv.kernels.mamba2_ref import mamba2_state_update_ref

pytestmark = pytest.mark.slow  # interpreted Triton

H, P, SLOTS = 4, 6, 9


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def nan_equal(a, b) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def weights(g, conv_dim, K, groups, mode):
    HP = H * P
    A_log = torch.randn(H, generator=g) * 0.5
    return dict(conv_weight=torch.randn(conv_dim, 1, K, generator=g), conv_bias=torch.randn(conv_dim, generator=g),
                A_log=A_log, dt_bias=torch.randn(H, generator=g) * 0.5, D=torch.randn(H, generator=g),
                norm_weight=torch.randn(HP, generator=g) if mode else None, norm_group=HP // groups, eps=1e-5,
                norm_mode=mode, num_heads=H, head_dim=P, n_groups=groups)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("N, groups, mode, K, conv_block", [(32, 1, 1, 4, 1024), (16, 2, 2, 3, 32), (16, 2, 0, 2, 64)])
def test_quantized_mixer_decode_matches_the_float_path(monkeypatch, dtype, N, groups, mode, K, conv_block):
    monkeypatch.setattr(mq, "CONV_BLOCK", conv_block)
    g = torch.Generator().manual_seed(N + groups + mode + K + len(dtype))
    HP, GN = H * P, groups * N
    conv_dim = HP + 2 * GN
    cl, sl = conv_layout(dtype, (conv_dim, K - 1)), state_layout(dtype, (H, P, N))
    kw = weights(g, conv_dim, K, groups, mode)
    w, cb = kw["conv_weight"][:, 0], kw["conv_bias"]
    A = -torch.exp(kw["A_log"])
    conv_q = cl.encode(torch.randn(SLOTS, conv_dim, K - 1, generator=g) * torch.exp(
        torch.empty(SLOTS, 1, K - 1).uniform_(-4, 4, generator=g)))
    ssm_vals = torch.randn(SLOTS, H, P, N, generator=g) * torch.exp(
        torch.empty(SLOTS, H, P, 1).uniform_(-6, 6, generator=g))
    ssm_vals[5, 1, 2, 3] = float("nan")  # one row of slot 5 decodes to NaN
    ssm_q = sl.encode(ssm_vals)
    slots = torch.tensor([7, 0, 5, 2], dtype=torch.int32)  # slot 0, the null slot, is never written back
    written = torch.tensor([7, 5, 2])
    for step in range(2):
        proj = torch.randn(4, 3 + HP + conv_dim + H, generator=g)[:, 3:] * 2  # strided rows
        z, xbc, dt = proj.split([HP, conv_dim, H], 1)
        # the float Triton path on the decoded slots, encoded after by the torch path
        conv_f, ssm_f = cl.decode(conv_q), sl.decode(ssm_q)
        conv_out = conv1d_update_triton(xbc, conv_f, w, cb, slots, "silu")
        x, B, C = conv_out.split([HP, GN, GN], 1)
        y_float = mamba2_state_update_triton(ssm_f, x.reshape(-1, H, P), dt, A, B.reshape(-1, groups, N),
                                             C.reshape(-1, groups, N), kw["D"], None, kw["dt_bias"], slots)
        want_y = mq.gated_norm(y_float.reshape(-1, HP), z, kw["norm_weight"], HP // groups, 1e-5, mode)
        want_conv, want_ssm = conv_q.clone(), ssm_q.clone()
        want_conv[written], want_ssm[written] = cl.encode(conv_f[written]), sl.encode(ssm_f[written])
        # the torch references
        conv_r, ssm_r = cl.decode(conv_q), sl.decode(ssm_q)
        xr, Br, Cr = conv1d_update_ref(xbc, conv_r, w, cb, slots, "silu").split([HP, GN, GN], 1)
        y_ref = mamba2_state_update_ref(ssm_r, xr.reshape(-1, H, P), dt, A, Br.reshape(-1, groups, N),
                                        Cr.reshape(-1, groups, N), kw["D"], None, kw["dt_bias"], slots)
        ref = mq.gated_norm(y_ref.reshape(-1, HP), z, kw["norm_weight"], HP // groups, 1e-5, mode)

        got = mq.mamba2_mixer_decode_q_triton(proj, slots, conv_pool=conv_q, conv_layout=cl, ssm_pool=ssm_q,
                                              ssm_layout=sl, cache={}, **kw)
        assert nan_equal(got, want_y)  # value for value
        finite = ~ref.isnan().any(1)
        assert torch.equal(finite, ~got.isnan().any(1)) and not finite[2]  # slot 5's request: NaN
        assert rel_err(got[finite], ref[finite]) < 1e-5
        assert torch.equal(conv_q, want_conv)
        ok = torch.tensor([s != 5 for s in range(SLOTS)])  # slot 5's NaN row: codes unspecified, values NaN
        assert torch.equal(ssm_q[ok], want_ssm[ok]) and nan_equal(sl.decode(ssm_q[5]), sl.decode(want_ssm[5]))


def test_the_op_runs_it_on_the_triton_backend_and_refuses_without_writing(monkeypatch):
    """HYBRIDKV_BACKEND=triton: ops.mamba2_mixer_decode_q is this kernel (CUDA's column); pools of
    another dtype or layout: None, and the pools untouched."""
    g = torch.Generator().manual_seed(3)
    N, conv_dim = 8, H * P + 16
    cl, sl = conv_layout("int8", (conv_dim, 3)), state_layout("int8", (H, P, N))
    conv_q = cl.encode(torch.randn(SLOTS, *cl.shape, generator=g))
    ssm_q = sl.encode(torch.randn(SLOTS, *sl.shape, generator=g))
    before = (conv_q.clone(), ssm_q.clone())
    kw = weights(g, conv_dim, 4, 1, 1)
    proj = torch.randn(2, H * P + conv_dim + H, generator=g)
    slots = torch.tensor([3, 4], dtype=torch.int32)
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    assert ops.mamba2_mixer_decode_q(proj, slots, conv_pool=conv_q.float(), conv_layout=cl, ssm_pool=ssm_q,
                                     ssm_layout=sl, cache={}, **kw) is None
    assert ops.mamba2_mixer_decode_q(proj, slots, conv_pool=conv_q, conv_layout=cl, ssm_pool=ssm_q,
                                     ssm_layout=state_layout("int8", (H, P, 4)), cache={}, **kw) is None
    assert torch.equal(conv_q, before[0]) and torch.equal(ssm_q, before[1])
    cpu_conv, cpu_ssm = conv_q.clone(), ssm_q.clone()
    got = ops.mamba2_mixer_decode_q(proj, slots, conv_pool=conv_q, conv_layout=cl, ssm_pool=ssm_q, ssm_layout=sl,
                                    cache={}, **kw)
    monkeypatch.setenv("HYBRIDKV_BACKEND", "torch")  # the C kernel on the same inputs
    same = ops.mamba2_mixer_decode_q(proj, slots, conv_pool=cpu_conv, conv_layout=cl, ssm_pool=cpu_ssm,
                                     ssm_layout=sl, cache={}, **kw)
    assert rel_err(got, same) < 1e-5 and not torch.equal(ssm_q, before[1])
    assert torch.equal(conv_q, cpu_conv)  # the window's bytes follow from its inputs alone
    assert (ssm_q.view(torch.int8)[:, :sl.numel].int() - cpu_ssm.view(torch.int8)[:, :sl.numel].int()).abs().max() <= 1
