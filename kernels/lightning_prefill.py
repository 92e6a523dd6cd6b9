"""Triton varlen chunked lightning attention (MiniMax prefill) over state slots; same contract as
`lightning_ref.lightning_chunk_scan_ref` (the spec, whose docstring derives the chunk algebra).

One launch over the chunk list of `scan_plan.py` (chunks never cross a request and are cut at
every requested checkpoint). A program owns one (request, head, V block) and walks the request's
chunks with the state tile S [K, BV] in registers; per chunk of c tokens with lam = exp(-slope):
    o = (lam^(i+1) q) S + ((q k^T) . lam^(i-j), j <= i) v
    S <- lam^c S + k^T (lam^(c-1-j) v)
(the end decay goes on the small [L, BV] value tile, not on k). With no delta correction there is
no WY system to solve, so the intra-chunk output rides along the recurrence instead of a separate
launch. Padded rows are zero and their decays masked, so nothing overflows at large slopes. The
chunk loop is a `while` (Triton 3.6's interpreter takes no tensor, nor a scalar kernel argument,
as a range() bound). Matmuls take fp16/bf16 operands with fp32 accumulation for half inputs,
exact fp32 products for fp32 inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lightning_ref import check_lightning_shapes
from .scan_plan import (build_scan_plan, check_packed_tokens, matmul_precision,
                         scan_result, unit_last_stride)
from .triton_math import device_guard


@triton.jit
def _lightning_chunk_recurrence(state_ptr, q_ptr, k_ptr, v_ptr, slope_ptr, o_ptr, ckpt_ptr,
                                chunk_start_ptr, chunk_len_ptr, chunk_ckpt_ptr, first_ptr,
                                nchunks_ptr, slot_ptr, init_ptr, write_ptr, max_chunks, n_heads,
                                key_dim, value_dim, s_ss, s_sh, s_sk, s_sv, s_qt, s_qh, s_kt, s_kh,
                                s_vt, s_vh, s_ot, s_oh,
                                PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, BLOCK_T)
    vmask = vs < value_dim
    kmask = ks < key_dim
    smask = kmask[:, None] & vmask[None, :]
    zero = ks[:, None] * 0 + vs[None, :] * 0  # scalar conditions join block masks as blocks
    slot = tl.load(slot_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r)
    first = tl.load(first_ptr + r)
    nch = tl.load(nchunks_ptr + r)
    in_ty = v_ptr.dtype.element_ty
    slope = tl.load(slope_ptr + h).to(tl.float32)
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + ks[:, None] * s_sk + vs[None, :] * s_sv
    S = tl.load(s_ptrs, mask=smask & (zero + init != 0), other=0.0).to(tl.float32)
    size = key_dim * value_dim
    tf = ts.to(tl.float32)
    causal = ts[:, None] >= ts[None, :]
    q_coef = tl.exp(-slope * (tf + 1.0))
    i = r * 0  # a tensor counter: max_chunks == 1 arrives as a constexpr
    while i < max_chunks:
        active = i < nch
        c = tl.where(active, first + i, 0).to(tl.int64)
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        length = tl.where(active, tl.load(chunk_len_ptr + c), 0)  # 0: every load below masked
        tmask = ts < length
        qk_mask = tmask[:, None] & kmask[None, :]
        vt_mask = tmask[:, None] & vmask[None, :]
        # 64-bit chunk bases, 32-bit offsets inside the tile (64-bit [L, K] address tiles spill)
        qq = tl.load(q_ptr + (start * s_qt + h * s_qh) + (ts[:, None] * s_qt + ks[None, :]),
                     mask=qk_mask, other=0.0)
        kk = tl.load(k_ptr + (start * s_kt + h * s_kh) + (ts[:, None] * s_kt + ks[None, :]),
                     mask=qk_mask, other=0.0)
        vv = tl.load(v_ptr + (start * s_vt + h * s_vh) + (ts[:, None] * s_vt + vs[None, :]),
                     mask=vt_mask, other=0.0)
        # lam^(i-j) for j <= i, rebuilt per chunk: a [L, L] fp32 tile held across the loop spills
        attn = tl.dot(qq, tl.trans(kk), input_precision=PREC) * tl.where(
            causal, tl.exp(-slope * tl.where(causal, tf[:, None] - tf[None, :], 0.0)), 0.0)
        # lam^(i+1) scales o's rows, not q: no fp32 copy of the [L, K] tile stays live
        o = tl.dot(qq, S.to(in_ty), input_precision=PREC) * q_coef[:, None]
        o += tl.dot(attn.to(in_ty), vv, input_precision=PREC)
        tl.store(o_ptr + (start * s_ot + h * s_oh) + (ts[:, None] * s_ot + vs[None, :]),
                 o.to(o_ptr.dtype.element_ty), mask=vt_mask)
        lf = length.to(tl.float32)
        v_end = vv.to(tl.float32) * tl.where(tmask, tl.exp(-slope * tl.where(tmask, lf - 1.0 - tf, 0.0)),
                              0.0)[:, None]
        S = tl.exp(-slope * lf) * S + tl.dot(tl.trans(kk), v_end.to(in_ty), input_precision=PREC)
        row = tl.where(active, tl.load(chunk_ckpt_ptr + c), -1).to(tl.int64)
        tl.store(ckpt_ptr + (row * n_heads + h) * size + ks[:, None] * value_dim + vs[None, :],
                 S.to(ckpt_ptr.dtype.element_ty), mask=smask & (zero + row >= 0))
        i += 1
    write = tl.load(write_ptr + r)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask & (zero + write != 0))


def lightning_chunk_scan_triton(state, q, k, v, slope, query_start_loc, slot_idx,
                                has_initial_state, chunk_size=64, return_states_at=None):
    """See lightning_ref.lightning_chunk_scan_ref. state [S, H, K, V] (final states written in
    place); q, k [T, H, K]; v [T, H, V]; slope [H]. Returns o [T, H, V] in v.dtype, or
    (o, states per request [n_pos, H, K, V] in state.dtype).
    """
    check_lightning_shapes(state, q, k, v, slope)
    check_packed_tokens(q, v, chunk_size)
    T, H, K = q.shape
    V = v.shape[2]
    block_k = max(16, triton.next_power_of_2(K))
    # the chunked form is exact at any cut, so the tile caps the chunk: [L, K] tiles of q and k
    # stay in registers (64 x 128 or 16 x 256) without spills
    chunk = min(chunk_size, 64 if block_k <= 128 else 16)
    plan = build_scan_plan(query_start_loc, slot_idx, has_initial_state, state.shape[0], T,
                           chunk, return_states_at, v.device)
    v = unit_last_stride(v)
    # one matmul operand dtype
    q, k = unit_last_stride(q).to(v.dtype), unit_last_stride(k).to(v.dtype)
    slope = slope.float().contiguous()
    o = torch.empty((T, H, V), dtype=v.dtype, device=v.device)
    ckpt = torch.empty((max(plan.num_ckpt, 1), H, K, V), dtype=state.dtype, device=v.device)
    prec = matmul_precision(v.dtype)
    block_t = max(16, triton.next_power_of_2(chunk))
    block_v = min(max(16, triton.next_power_of_2(V)), 32 if block_k <= 128 else 16)  # no spills
    with device_guard(v):
        if slot_idx.shape[0]:
            _lightning_chunk_recurrence[(slot_idx.shape[0], H, triton.cdiv(V, block_v))](
                state, q, k, v, slope, o, ckpt, plan.chunk_start, plan.chunk_len,
                plan.chunk_ckpt, plan.req_first_chunk, plan.req_num_chunks, plan.req_slot,
                plan.req_init, plan.req_write, plan.max_chunks, H, K, V, *state.stride(),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                o.stride(0), o.stride(1), PREC=prec, BLOCK_T=block_t, BLOCK_K=block_k,
                BLOCK_V=block_v, num_warps=8)
    return scan_result(o, ckpt, plan, return_states_at)
