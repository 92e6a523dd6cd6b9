"""Triton lightning-attention step (decode) over state slots; same signature as the reference.

One program owns one request, one head and BLOCK_V state columns with the whole key dim (o sums
over K): it decays the state tile by exp(-slope), adds k v^T, writes it back and reads o = S^T q.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lightning_ref import check_lightning_shapes
from .triton_math import device_guard


@triton.jit
def _lightning_step_kernel(state_ptr, q_ptr, k_ptr, v_ptr, slope_ptr, slot_ptr, o_ptr, k_dim, v_dim,
                           s_ss, s_sh, s_sk, s_sv, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ob, s_oh,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vcol = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < k_dim
    vmask = vcol < v_dim
    mask2 = kmask[:, None] & vmask[None, :]
    slot = tl.load(slot_ptr + b).to(tl.int64)

    q = tl.load(q_ptr + b * s_qb + h * s_qh + kk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * s_kb + h * s_kh + kk, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + vcol, mask=vmask, other=0.0).to(tl.float32)
    decay = tl.exp(-tl.load(slope_ptr + h).to(tl.float32))

    s_ptrs = state_ptr + slot * s_ss + h * s_sh + kk[:, None] * s_sk + vcol[None, :] * s_sv
    s = tl.load(s_ptrs, mask=mask2, other=0.0).to(tl.float32) * decay + k[:, None] * v[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask2)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + b * s_ob + h * s_oh + vcol, o.to(o_ptr.dtype.element_ty), mask=vmask)


def lightning_state_update_triton(state, q, k, v, slope, slot_idx):
    """See lightning_ref.lightning_state_update_ref. q, k [B, H, K]; v [B, H, V]; slope [H]
    -> o [B, H, V] in v.dtype; state [S, H, K, V] updated in place at slot_idx [B]."""
    check_lightning_shapes(state, q, k, v, slope)
    batch, heads, k_dim = q.shape
    v_dim = v.shape[2]
    # the kernel indexes key/value dims and the slopes with unit stride
    q, k, v, slope = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, slope))
    o = torch.empty_like(v)
    block_k = triton.next_power_of_2(k_dim)
    block_v = min(triton.next_power_of_2(v_dim), max(16, 4096 // block_k))
    grid = (batch, heads, triton.cdiv(v_dim, block_v))
    with device_guard(v):
        _lightning_step_kernel[grid](
            state, q, k, v, slope, slot_idx, o, k_dim, v_dim,
            state.stride(0), state.stride(1), state.stride(2), state.stride(3),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            o.stride(0), o.stride(1), BLOCK_K=block_k, BLOCK_V=block_v)
    return o
