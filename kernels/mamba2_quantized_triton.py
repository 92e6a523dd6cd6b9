"""A Mamba2 layer's one-token decode over quantized state pools in Triton, read and written in place
(ops.mamba2_mixer_decode_q on CUDA; the CPU's is mamba2_native.py, in C).

The pools keep each slot as one-byte codes and float32 scales (hybridkv/cache_dtype.py): the conv
window `[conv_dim, k-1]` with a scale per time step (a row across the channels), the SSM state
`[H, P, N]` with a scale per row of N. Two kernels and the gated norm in torch:
- `_conv_q_kernel`, a program per request: pass 1 walks the channels to find each new window row's
  max |value| (the window shifted by the new column, decoded), pass 2 computes the conv output
  silu(bias + taps . weight) (conv1d.py's order of sums) and encodes the new window with those
  scales; a barrier between every read and write of the slot's bytes;
- `_ssd_q_kernel`, a program per request, head and block of P rows: each row decoded, stepped
  (s = exp(dt A) s + dt x B, dt = softplus(dt + dt_bias), as mamba2.py's step), encoded back
  (quant_rows_triton.py: the bytes of QuantLayout.encode), y = s . C + D x from the full-precision
  state;
- the gated RMSNorm by z (GatedRMSNorm's formula) on y.
The null slot 0 is read but never written back. What it computes is the float path on the slots
decoded, encoded after: conv1d_update_triton and mamba2_state_update_triton value for value under
the interpreter (tests/kernels/test_mamba2_quantized_triton.py). Slots must be distinct (the
scheduler's are; no host sync checks them here).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .quant_rows_triton import decode_codes, encode_codes, fp8_values_on, row_amax, row_scale
from .triton_math import device_guard, silu, softplus

CONV_BLOCK = 1024  # channels a conv program takes at a time (a test sets fewer, to walk several blocks)


@triton.jit
def _conv_q_kernel(pool_ptr, pool_scale_ptr, fp8_values_ptr, slot_ptr, proj_ptr, w_ptr, b_ptr, xbc_ptr, stride_proj,
                   x_col, CONV_DIM: tl.constexpr, NBYTES: tl.constexpr, CODE_BYTES: tl.constexpr, KW: tl.constexpr,
                   KPAD: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    item = pool_ptr + slot * NBYTES
    scales = pool_scale_ptr + slot * (NBYTES // 4) + CODE_BYTES // 4
    x_row = proj_ptr + b.to(tl.int64) * stride_proj + x_col
    j = tl.arange(0, KPAD)  # new window row j: old row j + 1, the new column at j = KW - 2
    j_ok = j < KW - 1
    from_old = j + 1 < KW - 1
    old_scale = tl.load(scales + j + 1, mask=from_old, other=0.0)
    TOP: tl.constexpr = 448.0 if FP8 else 127.0
    # the null slot is never written back (a vector compare: the interpreter's bool & 0-d bool is no mask)
    keep = (j * 0 + slot) != 0

    # pass 1: each new row's max |value| over the channels
    amax = tl.zeros([KPAD], tl.float32)
    bad = amax < 0.0
    for c0 in range(0, CONV_DIM, BLOCK_C):  # (constexpr bounds: the interpreter takes them)
        new = _new_window(c0, CONV_DIM, item, x_row, old_scale, fp8_values_ptr, j, j_ok, from_old, KW, BLOCK_C, FP8)
        m, nb = row_amax(new, 0)
        amax = tl.maximum(amax, m)
        bad = bad | nb
    new_scale, inv = row_scale(amax, bad, TOP)

    # pass 2: the conv output and the new window's codes
    for c0 in range(0, CONV_DIM, BLOCK_C):  # (constexpr bounds: the interpreter takes them)
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < CONV_DIM
        if HAS_BIAS:
            acc = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_C], tl.float32)
        for t in tl.static_range(KW - 1):
            tap = decode_codes(tl.load(item + c * (KW - 1) + t, mask=c_ok, other=0), tl.load(scales + t),
                               fp8_values_ptr, FP8)
            acc += tap * tl.load(w_ptr + c * KW + t, mask=c_ok, other=0.0).to(tl.float32)
        x = tl.load(x_row + c, mask=c_ok, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + c * KW + KW - 1, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(xbc_ptr + b.to(tl.int64) * CONV_DIM + c, silu(acc), mask=c_ok)
        new = _new_window(c0, CONV_DIM, item, x_row, old_scale, fp8_values_ptr, j, j_ok, from_old, KW, BLOCK_C, FP8)
        tl.debug_barrier()  # every thread has read these channels' old window before any writes it
        tl.store(item + c[:, None] * (KW - 1) + j[None, :], encode_codes(new, inv[None, :], FP8),
                 mask=c_ok[:, None] & (j_ok & keep)[None, :])
    tl.debug_barrier()  # the old scales (read above) are replaced last
    tl.store(scales + j, new_scale, mask=j_ok & keep)


@triton.jit
def _new_window(c0, conv_dim, item, x_row, old_scale, fp8_values_ptr, j, j_ok, from_old, KW: tl.constexpr,
                BLOCK_C: tl.constexpr, FP8: tl.constexpr):
    """Channels c0 .. c0 + BLOCK_C of the shifted window, [BLOCK_C, KPAD] fp32 (0 past the rows)."""
    c = c0 + tl.arange(0, BLOCK_C)
    c_ok = c < conv_dim
    codes = tl.load(item + c[:, None] * (KW - 1) + j[None, :] + 1, mask=c_ok[:, None] & from_old[None, :], other=0)
    old = decode_codes(codes, old_scale[None, :], fp8_values_ptr, FP8)
    x = tl.load(x_row + c, mask=c_ok, other=0.0).to(tl.float32)
    new = tl.where(from_old[None, :], old, x[:, None])
    return tl.where(j_ok[None, :], new, 0.0)


@triton.jit
def _ssd_q_kernel(pool_ptr, pool_scale_ptr, fp8_values_ptr, slot_ptr, xbc_ptr, proj_ptr, stride_proj, dt_col,
                  a_ptr, d_ptr, dtb_ptr, y_ptr, head_dim, n_state, heads_per_group, conv_dim, x_dim, gn,
                  NBYTES: tl.constexpr, CODE_BYTES: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                  FP8: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pmask = p < head_dim
    nmask = n < n_state
    mask2 = pmask[:, None] & nmask[None, :]
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)

    dt = tl.load(proj_ptr + b.to(tl.int64) * stride_proj + dt_col + h).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dtb_ptr + h).to(tl.float32)
    dt = softplus(dt)
    decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    xbc = xbc_ptr + b.to(tl.int64) * conv_dim
    x = tl.load(xbc + h * head_dim + p, mask=pmask, other=0.0)
    Bv = tl.load(xbc + x_dim + g * n_state + n, mask=nmask, other=0.0)
    Cv = tl.load(xbc + x_dim + gn + g * n_state + n, mask=nmask, other=0.0)
    row = h * head_dim + p  # the state's rows of this program, one scale each
    codes_at = pool_ptr + slot * NBYTES + row[:, None] * n_state + n[None, :]
    scale_at = pool_scale_ptr + slot * (NBYTES // 4) + CODE_BYTES // 4 + row
    s = decode_codes(tl.load(codes_at, mask=mask2, other=0), tl.load(scale_at, mask=pmask, other=0.0)[:, None],
                     fp8_values_ptr, FP8)
    s = decay * s + (dt * x)[:, None] * Bv[None, :]
    amax, bad = row_amax(tl.where(mask2, s, 0.0), 1)
    scale, inv = row_scale(amax, bad, 448.0 if FP8 else 127.0)
    keep = pmask & ((p * 0 + slot) != 0)  # the null slot is never written back (see _conv_q_kernel)
    tl.store(codes_at, encode_codes(s, inv[:, None], FP8), mask=keep[:, None] & nmask[None, :])  # its own bytes only
    tl.store(scale_at, scale, mask=keep)
    y = tl.sum(s * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(d_ptr + h).to(tl.float32)
    tl.store(y_ptr + b.to(tl.int64) * (x_dim) + row, y, mask=pmask)


def gated_norm(y: torch.Tensor, z: torch.Tensor, weight, group: int, eps: float, mode: int) -> torch.Tensor:
    """y, z [B, H P] fp32 -> mode 1: norm(y silu(z)) w; 2: norm(y) w silu(z); 0: y silu(z) (RMS over
    groups of `group`; models/norms.py GatedRMSNorm's formula)."""
    def norm(h):
        g = h.view(h.shape[0], -1, group)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)

    gate = F.silu(z.float())
    if mode == 0:
        return y * gate
    return weight.float() * norm(y * gate) if mode == 1 else weight.float() * norm(y) * gate


def _pool_ok(pool: torch.Tensor, layout, shape: tuple) -> bool:
    return (pool.dtype == torch.uint8 and pool.dim() == 2 and pool.is_contiguous() and pool.shape[1] == layout.nbytes
            and tuple(layout.shape) == tuple(shape) and layout.dtype in ("int8", "fp8_e4m3"))


def mamba2_mixer_decode_q_triton(proj, slot_idx, *, conv_pool, conv_layout, ssm_pool, ssm_layout, num_heads, head_dim,
                                 n_groups, conv_weight, conv_bias, A_log, dt_bias, D, norm_weight, norm_group, eps,
                                 norm_mode, cache: dict):
    """ops.mamba2_mixer_decode_q in Triton: proj [B, H P + conv_dim + H] (in_proj's rows [z | xBC | dt]),
    slot_idx [B] (distinct) -> y [B, H P] fp32, conv_pool [S, conv nbytes] and ssm_pool [S, ssm nbytes]
    (uint8, their layouts hybridkv.cache_dtype.QuantLayout) updated in place at the slots (not slot 0).
    Weights as mamba2_native.Mamba2MixerDecode (conv_weight [conv_dim, k] or [conv_dim, 1, k]). None,
    nothing written, when the inputs are not ones it takes. cache: unused (the op's signature)."""
    H, P, G = num_heads, head_dim, n_groups
    w = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight
    conv_dim, k = w.shape
    N = ssm_layout.shape[-1]
    B = proj.shape[0]
    if not (_pool_ok(conv_pool, conv_layout, (conv_dim, k - 1)) and _pool_ok(ssm_pool, ssm_layout, (H, P, N))
            and conv_dim == H * P + 2 * G * N and H % G == 0 and k >= 2 and proj.dim() == 2
            and proj.shape[1] == H * P + conv_dim + H and proj.stride(1) == 1 and conv_pool.shape[0] == ssm_pool.shape[0]
            and all(t.device == proj.device for t in (conv_pool, ssm_pool, slot_idx, w))):
        return None
    dev = proj.device
    xbc = torch.empty(B, conv_dim, dtype=torch.float32, device=dev)
    y = torch.empty(B, H * P, dtype=torch.float32, device=dev)
    if B == 0:
        return y
    w = w.contiguous()
    fp8_values = fp8_values_on(dev) if "fp8_e4m3" in (conv_layout.dtype, ssm_layout.dtype) else y
    A = -torch.exp(A_log.float())  # as the mixer's float path
    block_n = triton.next_power_of_2(N)
    block_p = min(triton.next_power_of_2(P), max(16, 4096 // block_n))
    with device_guard(proj):
        _conv_q_kernel[(B,)](
            conv_pool, conv_pool.view(torch.float32), fp8_values, slot_idx, proj, w,
            w if conv_bias is None else conv_bias, xbc, proj.stride(0), H * P, CONV_DIM=conv_dim, NBYTES=conv_layout.nbytes,
            CODE_BYTES=conv_layout.code_bytes, KW=k, KPAD=triton.next_power_of_2(k - 1),
            BLOCK_C=min(CONV_BLOCK, triton.next_power_of_2(conv_dim)), HAS_BIAS=conv_bias is not None,
            FP8=conv_layout.dtype == "fp8_e4m3")
        _ssd_q_kernel[(B, H, triton.cdiv(P, block_p))](
            ssm_pool, ssm_pool.view(torch.float32), fp8_values, slot_idx, xbc, proj, proj.stride(0),
            H * P + conv_dim, A, A if D is None else D, A if dt_bias is None else dt_bias, y, P, N, H // G, conv_dim,
            H * P, G * N, NBYTES=ssm_layout.nbytes, CODE_BYTES=ssm_layout.code_bytes, HAS_D=D is not None,
            HAS_DT_BIAS=dt_bias is not None, FP8=ssm_layout.dtype == "fp8_e4m3", BLOCK_P=block_p, BLOCK_N=block_n)
    return gated_norm(y, proj[:, :H * P], norm_weight, norm_group, eps, norm_mode)
