"""Triton Mamba1 selective-scan step (decode) over state slots; same signature as the reference.

One program owns one request and BLOCK_D channels with all N states of each: it reads the slot's
state tile once, applies h <- exp(dt A) h + dt B x, writes it back, and reduces y = C.h.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_math import device_guard, silu, softplus


@triton.jit
def _mamba1_step_kernel(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr,
                        slot_ptr, y_ptr, d_inner, n_state,
                        s_ss, s_sd, s_sn, s_xb, s_dtb, s_ad, s_an, s_bb, s_cb, s_zb, s_yb,
                        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                        DT_SOFTPLUS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    dmask = d < d_inner
    nmask = n < n_state
    mask2 = dmask[:, None] & nmask[None, :]
    slot = tl.load(slot_ptr + b).to(tl.int64)

    x = tl.load(x_ptr + b * s_xb + d, mask=dmask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * s_dtb + d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dtb_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        dt = softplus(dt)
    A = tl.load(a_ptr + d[:, None] * s_ad + n[None, :] * s_an, mask=mask2, other=0.0).to(tl.float32)
    Bv = tl.load(b_ptr + b * s_bb + n, mask=nmask, other=0.0).to(tl.float32)
    Cv = tl.load(c_ptr + b * s_cb + n, mask=nmask, other=0.0).to(tl.float32)
    h_ptrs = state_ptr + slot * s_ss + d[:, None] * s_sd + n[None, :] * s_sn
    h = tl.load(h_ptrs, mask=mask2, other=0.0).to(tl.float32)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * Bv[None, :]
    tl.store(h_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask2)

    y = tl.sum(h * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(d_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_Z:
        y *= silu(tl.load(z_ptr + b * s_zb + d, mask=dmask, other=0.0).to(tl.float32))
    tl.store(y_ptr + b * s_yb + d, y.to(y_ptr.dtype.element_ty), mask=dmask)


def mamba1_state_update_triton(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                               dt_softplus=True):
    """See mamba1_ref.mamba1_state_update_ref. x, dt [B, d_inner] -> y [B, d_inner] in x.dtype."""
    batch, d_inner = x.shape
    n_state = ssm_state.shape[-1]
    if ssm_state.shape[1:] != (d_inner, n_state) or A.shape != (d_inner, n_state):
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)} and A {tuple(A.shape)} must be "
                         f"[S, {d_inner}, N] and [{d_inner}, N] for x {tuple(x.shape)}")
    # the kernel indexes channels and states with unit stride
    x, dt, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dt, B, C))
    z = None if z is None else (z if z.stride(-1) == 1 else z.contiguous())
    y = torch.empty_like(x)
    block_n = triton.next_power_of_2(n_state)
    block_d = min(triton.next_power_of_2(d_inner), max(16, 4096 // block_n))
    grid = (batch, triton.cdiv(d_inner, block_d))
    with device_guard(x):
        _mamba1_step_kernel[grid](
            ssm_state, x, dt, A, B, C, D if D is not None else x, z if z is not None else x,
            dt_bias if dt_bias is not None else x, slot_idx, y, d_inner, n_state,
            ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), x.stride(0),
            dt.stride(0), A.stride(0), A.stride(1), B.stride(0), C.stride(0),
            z.stride(0) if z is not None else 0, y.stride(0),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus), BLOCK_D=block_d, BLOCK_N=block_n)
    return y
