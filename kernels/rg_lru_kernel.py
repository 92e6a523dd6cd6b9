"""Triton RG-LRU decode step over state slots; same signature as the reference
(kernels/rg_lru_ref.py). One program owns one request and BLOCK_W channels: it reads the slot's
state once, applies h <- a h + sqrt(1 - a^2) (i x) with log a = -8 r softplus(c), writes h back
and returns it as y.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rg_lru_ref import check_widths
from .triton_math import device_guard, softplus


@triton.jit
def _rg_lru_step_kernel(state_ptr, x_ptr, gi_ptr, gr_ptr, c_ptr, slot_ptr, y_ptr, width,
                        s_ss, s_xb, s_gib, s_grb, s_yb, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = w < width
    slot = tl.load(slot_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b * s_xb + w, mask=mask, other=0.0).to(tl.float32)
    gi = tl.load(gi_ptr + b * s_gib + w, mask=mask, other=0.0).to(tl.float32)
    gr = tl.load(gr_ptr + b * s_grb + w, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + w, mask=mask, other=0.0).to(tl.float32)
    log_a = -8.0 * gr * softplus(c)
    a = tl.exp(log_a)
    h = tl.load(state_ptr + slot * s_ss + w, mask=mask, other=0.0).to(tl.float32)
    h = a * h + x * gi * tl.sqrt(1.0 - tl.exp(2.0 * log_a))
    tl.store(state_ptr + slot * s_ss + w, h.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + b * s_yb + w, h.to(y_ptr.dtype.element_ty), mask=mask)


def rg_lru_state_update_triton(state, x, input_gate, recurrent_gate, recurrent_param, slot_idx):
    """See rg_lru_ref.rg_lru_state_update_ref. x [B, W] -> y [B, W] in x.dtype."""
    check_widths(state, x, input_gate, recurrent_gate, recurrent_param)
    if state.stride(-1) != 1:
        raise ValueError(f"the RG-LRU state pool must have unit stride over its width; got strides "
                         f"{tuple(state.stride())}")
    # the kernel indexes channels with unit stride
    x, gi, gr, c = (t if t.stride(-1) == 1 else t.contiguous()
                    for t in (x, input_gate, recurrent_gate, recurrent_param))
    batch, width = x.shape
    y = torch.empty_like(x)
    block_w = min(triton.next_power_of_2(width), 1024)
    with device_guard(x):
        _rg_lru_step_kernel[(batch, triton.cdiv(width, block_w))](
            state, x, gi, gr, c, slot_idx, y, width, state.stride(0), x.stride(0), gi.stride(0),
            gr.stride(0), y.stride(0), BLOCK_W=block_w)
    return y
