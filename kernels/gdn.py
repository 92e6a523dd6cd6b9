"""Triton gated delta rule step (decode) over state slots; same signature as the reference.

One program owns one request, one value head and BLOCK_V state columns with the whole key dim
(the delta needs S^T k reduced over K): it L2-normalises q and k of the head's q/k head
(hv // (HV // H)), decays the state tile, applies the delta update, writes it back and reads o.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_math import device_guard


@triton.jit
def _gdn_step_kernel(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, o_ptr,
                     k_dim, v_dim, v_per_qk, scale,
                     s_ss, s_sh, s_sk, s_sv, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_bb,
                     s_ob, s_oh,
                     L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vcol = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < k_dim
    vmask = vcol < v_dim
    mask2 = kmask[:, None] & vmask[None, :]
    hq = hv // v_per_qk
    slot = tl.load(slot_ptr + b).to(tl.int64)

    q = tl.load(q_ptr + b * s_qb + hq * s_qh + kk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * s_kb + hq * s_kh + kk, mask=kmask, other=0.0).to(tl.float32)
    if L2NORM:
        # eps inside the rsqrt, as transformers' l2norm (and FLA) do
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(v_ptr + b * s_vb + hv * s_vh + vcol, mask=vmask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * s_gb + hv).to(tl.float32))
    beta = tl.load(beta_ptr + b * s_bb + hv).to(tl.float32)

    s_ptrs = state_ptr + slot * s_ss + hv * s_sh + kk[:, None] * s_sk + vcol[None, :] * s_sv
    s = tl.load(s_ptrs, mask=mask2, other=0.0).to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask2)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + b * s_ob + hv * s_oh + vcol, o.to(o_ptr.dtype.element_ty), mask=vmask)


def gdn_state_update_triton(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """See gdn_ref.gdn_state_update_ref. q, k [B, H, K]; v [B, HV, V] -> o [B, HV, V] in v.dtype."""
    batch, qk_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[1], v.shape[2]
    if v_heads % qk_heads or state.shape[1:] != (v_heads, k_dim, v_dim):
        raise ValueError(f"state {tuple(state.shape)} must be [S, {v_heads}, {k_dim}, {v_dim}] and "
                         f"{v_heads} value heads a multiple of {qk_heads} q/k heads")
    # the kernel indexes key/value dims and the heads of g and beta with unit stride
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty_like(v)
    block_k = triton.next_power_of_2(k_dim)
    block_v = min(triton.next_power_of_2(v_dim), max(16, 4096 // block_k))
    grid = (batch, v_heads, triton.cdiv(v_dim, block_v))
    with device_guard(v):
        _gdn_step_kernel[grid](
            state, q, k, v, g, beta, slot_idx, o, k_dim, v_dim, v_heads // qk_heads,
            float(k_dim ** -0.5 if scale is None else scale),
            state.stride(0), state.stride(1), state.stride(2), state.stride(3),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
            L2NORM=bool(use_qk_l2norm), BLOCK_K=block_k, BLOCK_V=block_v)
    return o
