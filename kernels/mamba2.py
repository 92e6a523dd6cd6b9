"""Triton Mamba2 SSD step (decode) over state slots; same signature as the reference.

One program owns one request, one head and BLOCK_P of its head_dim rows with all N states: dt, A
and D are scalars per head, B and C come from the head's group (h // (H // G)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_math import device_guard, silu, softplus


@triton.jit
def _mamba2_step_kernel(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr,
                        slot_ptr, y_ptr, head_dim, n_state, heads_per_group, dt_min, dt_max,
                        s_ss, s_sh, s_sp, s_sn, s_xb, s_xh, s_dtb, s_bb, s_bg, s_cb, s_cg,
                        s_zb, s_zh, s_yb, s_yh,
                        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                        DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pmask = p < head_dim
    nmask = n < n_state
    mask2 = pmask[:, None] & nmask[None, :]
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)

    dt = tl.load(dt_ptr + b * s_dtb + h).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dtb_ptr + h).to(tl.float32)
    if DT_SOFTPLUS:
        dt = softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * s_xb + h * s_xh + p, mask=pmask, other=0.0).to(tl.float32)
    Bv = tl.load(b_ptr + b * s_bb + g * s_bg + n, mask=nmask, other=0.0).to(tl.float32)
    Cv = tl.load(c_ptr + b * s_cb + g * s_cg + n, mask=nmask, other=0.0).to(tl.float32)
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + p[:, None] * s_sp + n[None, :] * s_sn
    s = tl.load(s_ptrs, mask=mask2, other=0.0).to(tl.float32)
    s = decay * s + (dt * x)[:, None] * Bv[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask2)

    y = tl.sum(s * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(d_ptr + h).to(tl.float32)
    if HAS_Z:
        y *= silu(tl.load(z_ptr + b * s_zb + h * s_zh + p, mask=pmask, other=0.0).to(tl.float32))
    tl.store(y_ptr + b * s_yb + h * s_yh + p, y.to(y_ptr.dtype.element_ty), mask=pmask)


def mamba2_state_update_triton(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                               dt_softplus=True, dt_limit=None):
    """See mamba2_ref.mamba2_state_update_ref. x [B, H, P] -> y [B, H, P] in x.dtype."""
    batch, heads, head_dim = x.shape
    groups, n_state = B.shape[1], B.shape[2]
    if heads % groups or ssm_state.shape[1:] != (heads, head_dim, n_state):
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)} must be [S, {heads}, {head_dim}, "
                         f"{n_state}] and {heads} heads a multiple of {groups} B/C groups")
    # the kernel indexes head_dim rows, states and heads of dt with unit stride
    x, dt, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dt, B, C))
    z = None if z is None else (z if z.stride(-1) == 1 else z.contiguous())
    y = torch.empty_like(x)
    block_n = triton.next_power_of_2(n_state)
    block_p = min(triton.next_power_of_2(head_dim), max(16, 4096 // block_n))
    lo, hi = (0.0, float("inf")) if dt_limit is None else (float(dt_limit[0]), float(dt_limit[1]))
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    with device_guard(x):
        _mamba2_step_kernel[grid](
            ssm_state, x, dt, A, B, C, D if D is not None else x, z if z is not None else x,
            dt_bias if dt_bias is not None else x, slot_idx, y, head_dim, n_state,
            heads // groups, lo, hi, ssm_state.stride(0), ssm_state.stride(1),
            ssm_state.stride(2), ssm_state.stride(3), x.stride(0), x.stride(1), dt.stride(0),
            B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
            y.stride(0), y.stride(1),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus), HAS_LIMIT=dt_limit is not None, BLOCK_P=block_p,
            BLOCK_N=block_n)
    return y
