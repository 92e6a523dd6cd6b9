"""Triton varlen chunked Kimi delta attention (KDA prefill, Kimi-Linear / BailingHybrid) over state
slots; same contract as `kda_ref.kda_chunk_scan_ref` (the spec, whose docstring derives the algebra).

The WY form of `gdn_prefill.py` with a log-decay per key channel instead of per head, over the
chunk list of `scan_plan.py` (chunks never cross a request and are cut at every checkpoint), three
launches:
  1. prep        per (chunk, head): the per-channel running log-decay G = cumsum(g) [L, K];
                 A_ij = sum_c k_ic k_jc e^(G_ic - G_jc) (j < i) and QK_ij = sum_c q_ic k_jc
                 e^(G_ic - G_jc) (j <= i) built one key channel at a time, so every exponent is a
                 difference <= 0 and nothing overflows however strong the decay (the factored form
                 (k e^G)(k e^-G)^T overflows fp32 past ~88 nats of decay per chunk);
                 T = (I + beta A)^-1 as a product of log2(L) matmuls (beta A is nilpotent);
                 stores w = T (beta e^G k), u0 = T (beta v), e^G q, e^(G_last - G) k, QK and
                 e^(G_last) per chunk;
  2. recurrence  per (request, head, V block), chunk after chunk from the slot's state S [K, BV]:
                 u = u0 - w S, S <- e^(G_last) . S + (e^(G_last - G) k)^T u; stores each chunk's
                 entering state, u, the requested checkpoints and the final state into the slot;
  3. output      per (chunk, head, V block): o = (e^G q) S_start + QK u.
The chunk is capped at 16 tokens (exact at any cut): the prep's fp32 [L, K] tiles fit at K = 256.
q and k are L2-normalised (x / sqrt(|x|^2 + 1e-6)) and q scaled by torch before the launches. Tile
loops have constexpr bounds and the chunk loop is a `while` (Triton 3.6's interpreter takes no
tensor, nor a scalar kernel argument, as a range() bound). Matmuls take fp16/bf16 operands with
fp32 accumulation for half inputs, exact fp32 products for fp32 inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kda_ref import check_kda_shapes, prepare_qk
from .scan_plan import (build_scan_plan, check_packed_tokens, matmul_precision,
                         scan_result, unit_last_stride)
from .triton_math import device_guard


@triton.jit
def _kda_chunk_prep(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_len_ptr, w_ptr,
                    u_ptr, qdec_ptr, kend_ptr, qk_ptr, glast_ptr, n_heads, key_dim, value_dim,
                    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh,
                    PREC: tl.constexpr, LOG2_T: tl.constexpr, KEY_DIM: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    ts = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.arange(0, BLOCK_V)
    tmask = ts < length
    rows = start + ts
    in_ty = v_ptr.dtype.element_ty
    causal = ts[:, None] >= ts[None, :]
    strict = ts[:, None] > ts[None, :]
    A = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    QK = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for ch in range(0, KEY_DIM):  # the exact key dim (constexpr): one channel's decays at a time
        kc = tl.load(k_ptr + rows * s_kt + h * s_kh + ch, mask=tmask, other=0.0).to(tl.float32)
        qc = tl.load(q_ptr + rows * s_qt + h * s_qh + ch, mask=tmask, other=0.0).to(tl.float32)
        gc = tl.cumsum(tl.load(g_ptr + rows * s_gt + h * s_gh + ch, mask=tmask,
                               other=0.0).to(tl.float32), axis=0)
        pair = tl.where(causal, tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        kpair = kc[None, :] * pair
        A += kc[:, None] * kpair
        QK += qc[:, None] * kpair
    bb = tl.load(beta_ptr + rows * s_bt + h * s_bh, mask=tmask, other=0.0).to(tl.float32)
    kmask = tmask[:, None] & (ks[None, :] < key_dim)
    gt = tl.load(g_ptr + rows[:, None] * s_gt + h * s_gh + ks[None, :], mask=kmask,
                 other=0.0).to(tl.float32)
    G = tl.cumsum(gt, axis=0)  # [L, K]; padded rows repeat the last row (g = 0 there)
    g_last = tl.sum(tl.where(ts[:, None] == length - 1, G, 0.0), axis=0)  # [K]
    # M = -beta A (strictly lower, so nilpotent): (I + beta A)^-1 = (I + M)(I + M^2)(I + M^4)...
    M = tl.where(strict, -bb[:, None] * A, 0.0)
    inv = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0) + M
    for _ in tl.static_range(1, LOG2_T):
        M = tl.dot(M.to(in_ty), M.to(in_ty), input_precision=PREC)
        inv = inv + tl.dot(inv.to(in_ty), M.to(in_ty), input_precision=PREC)
    inv_in = inv.to(in_ty)
    kk = tl.load(k_ptr + rows[:, None] * s_kt + h * s_kh + ks[None, :], mask=kmask,
                 other=0.0).to(tl.float32)
    qq = tl.load(q_ptr + rows[:, None] * s_qt + h * s_qh + ks[None, :], mask=kmask,
                 other=0.0).to(tl.float32)
    eG = tl.exp(G)
    k_offs = (rows[:, None] * n_heads + h) * key_dim + ks[None, :]
    w = tl.dot(inv_in, (kk * eG * bb[:, None]).to(in_ty), input_precision=PREC)
    tl.store(w_ptr + k_offs, w, mask=kmask)
    tl.store(qdec_ptr + k_offs, qq * eG, mask=kmask)
    tl.store(kend_ptr + k_offs, kk * tl.exp(tl.where(kmask, g_last[None, :] - G, 0.0)), mask=kmask)
    tl.store(glast_ptr + (c.to(tl.int64) * n_heads + h) * key_dim + ks, g_last, mask=ks < key_dim)
    tl.store(qk_ptr + (rows[:, None] * n_heads + h) * BLOCK_T + ts[None, :], QK,
             mask=tmask[:, None])
    vmask = tmask[:, None] & (vs[None, :] < value_dim)
    vt = tl.load(v_ptr + rows[:, None] * s_vt + h * s_vh + vs[None, :], mask=vmask,
                 other=0.0).to(tl.float32)
    u = tl.dot(inv_in, (vt * bb[:, None]).to(in_ty), input_precision=PREC)
    tl.store(u_ptr + (rows[:, None] * n_heads + h) * value_dim + vs[None, :], u, mask=vmask)


@triton.jit
def _kda_recurrence(state_ptr, w_ptr, u_ptr, kend_ptr, glast_ptr, hstart_ptr, ckpt_ptr, chunk_start_ptr, chunk_len_ptr, chunk_ckpt_ptr, first_ptr,
                    nchunks_ptr, slot_ptr, init_ptr, write_ptr, max_chunks, n_heads, key_dim,
                    value_dim, s_ss, s_sh, s_sk, s_sv,
                    PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, BLOCK_T)
    vmask = vs < value_dim
    kin = ks < key_dim
    smask = kin[:, None] & vmask[None, :]
    zero = ks[:, None] * 0 + vs[None, :] * 0  # scalar conditions join block masks as blocks
    slot = tl.load(slot_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r)
    first = tl.load(first_ptr + r)
    nch = tl.load(nchunks_ptr + r)
    in_ty = kend_ptr.dtype.element_ty  # e^(G_last - G) k is kept in the operand dtype
    # scalar 64-bit bases, 32-bit [K, BV] offsets: a 64-bit address tile held across the loop spills
    s_base = state_ptr + slot * s_ss + h * s_sh
    s_offs = ks[:, None] * s_sk + vs[None, :] * s_sv
    S = tl.load(s_base + s_offs, mask=smask & (zero + init != 0), other=0.0).to(tl.float32)
    size = key_dim * value_dim
    c_offs = ks[:, None] * value_dim + vs[None, :]
    i = r * 0  # a tensor counter: max_chunks == 1 arrives as a constexpr
    while i < max_chunks:
        active = i < nch
        c = tl.where(active, first + i, 0).to(tl.int64)
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        length = tl.where(active, tl.load(chunk_len_ptr + c), 0)  # 0: every load below masked
        tmask = ts < length
        kmask = tmask[:, None] & kin[None, :]
        umask = tmask[:, None] & vmask[None, :]
        # 64-bit chunk bases, 32-bit offsets inside the tile (64-bit address tiles spill)
        k_offs = ts[:, None] * (n_heads * key_dim) + ks[None, :]
        k_base = (start * n_heads + h) * key_dim
        w = tl.load(w_ptr + k_base + k_offs, mask=kmask, other=0.0).to(in_ty)
        ke = tl.load(kend_ptr + k_base + k_offs, mask=kmask, other=0.0).to(in_ty)
        g_last = tl.load(glast_ptr + (c * n_heads + h) * key_dim + ks,
                         mask=kin & (ks * 0 + i < nch), other=0.0)
        tl.store(hstart_ptr + (c * n_heads + h) * size + c_offs, S,
                 mask=smask & (zero + i < nch))
        u_ptrs = u_ptr + (start * n_heads + h) * value_dim + (ts[:, None] * (n_heads * value_dim)
                                                              + vs[None, :])
        u = tl.load(u_ptrs, mask=umask, other=0.0) - tl.dot(w, S.to(in_ty), input_precision=PREC)
        tl.store(u_ptrs, u, mask=umask)  # u0 becomes the corrected u the output kernel reads
        S = tl.exp(g_last)[:, None] * S + tl.dot(tl.trans(ke), u.to(in_ty), input_precision=PREC)
        row = tl.where(active, tl.load(chunk_ckpt_ptr + c), -1).to(tl.int64)
        tl.store(ckpt_ptr + (row * n_heads + h) * size + c_offs,
                 S.to(ckpt_ptr.dtype.element_ty), mask=smask & (zero + row >= 0))
        i += 1
    write = tl.load(write_ptr + r)
    tl.store(s_base + s_offs, S.to(state_ptr.dtype.element_ty), mask=smask & (zero + write != 0))


@triton.jit
def _kda_chunk_output(qdec_ptr, qk_ptr, u_ptr, hstart_ptr, o_ptr, chunk_start_ptr, chunk_len_ptr,
                      n_heads, key_dim, value_dim, s_ot, s_oh,
                      PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, BLOCK_T)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    tmask = ts < length
    vmask = vs < value_dim
    umask = tmask[:, None] & vmask[None, :]
    in_ty = o_ptr.dtype.element_ty
    qd = tl.load(qdec_ptr + (start * n_heads + h) * key_dim
                 + (ts[:, None] * (n_heads * key_dim) + ks[None, :]),
                 mask=tmask[:, None] & (ks[None, :] < key_dim), other=0.0)
    qk = tl.load(qk_ptr + (start * n_heads + h) * BLOCK_T
                 + (ts[:, None] * (n_heads * BLOCK_T) + ts[None, :]), mask=tmask[:, None],
                 other=0.0)
    u = tl.load(u_ptr + (start * n_heads + h) * value_dim
                + (ts[:, None] * (n_heads * value_dim) + vs[None, :]), mask=umask, other=0.0)
    S = tl.load(hstart_ptr + (c.to(tl.int64) * n_heads + h) * key_dim * value_dim
                + (ks[:, None] * value_dim + vs[None, :]),
                mask=(ks[:, None] < key_dim) & vmask[None, :], other=0.0)
    o = tl.dot(qd.to(in_ty), S.to(in_ty), input_precision=PREC)
    o += tl.dot(qk.to(in_ty), u.to(in_ty), input_precision=PREC)
    tl.store(o_ptr + (start * s_ot + h * s_oh) + (ts[:, None] * s_ot + vs[None, :]),
             o.to(o_ptr.dtype.element_ty), mask=umask)


def kda_chunk_scan_triton(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state,
                          scale=None, use_qk_l2norm=True, chunk_size=16, return_states_at=None):
    """See kda_ref.kda_chunk_scan_ref. state [S, H, K, V] (final states written in place);
    q, k, g [T, H, K]; v [T, H, V]; beta [T, H]. Returns o [T, H, V] in v.dtype, or
    (o, states per request [n_pos, H, K, V] in state.dtype).
    """
    check_kda_shapes(state, q, k, v, g, beta)
    check_packed_tokens(q, v, chunk_size)
    T, H, K = q.shape
    V = v.shape[2]
    # the chunked form is exact at any cut, so the tiles cap the chunk at 16 tokens: the prep's
    # fp32 [L, K] tiles (G, e^G, k, q) stay in registers at K = 256
    chunk = min(chunk_size, 16)
    plan = build_scan_plan(query_start_loc, slot_idx, has_initial_state, state.shape[0], T,
                           chunk, return_states_at, v.device)
    v, g = unit_last_stride(v), unit_last_stride(g)
    q, k = (unit_last_stride(t) for t in prepare_qk(q, k, scale, use_qk_l2norm))  # fp32, q scaled
    dev, f32 = v.device, torch.float32
    block_t = 16
    block_k = max(16, triton.next_power_of_2(K))
    block_v_full = max(16, triton.next_power_of_2(V))
    block_v = min(block_v_full, 32 if block_k <= 128 else 16)  # no spills on sm_90
    o = torch.empty((T, H, V), dtype=v.dtype, device=dev)
    w, qdec = (torch.empty((T, H, K), dtype=f32, device=dev) for _ in range(2))
    kend = torch.empty((T, H, K), dtype=v.dtype, device=dev)
    u = torch.empty((T, H, V), dtype=f32, device=dev)
    qk = torch.empty((T, H, block_t), dtype=f32, device=dev)
    nc = plan.num_chunks
    glast = torch.empty((max(nc, 1), H, K), dtype=f32, device=dev)
    hstart = torch.empty((max(nc, 1), H, K, V), dtype=f32, device=dev)
    ckpt = torch.empty((max(plan.num_ckpt, 1), H, K, V), dtype=state.dtype, device=dev)
    prec = matmul_precision(v.dtype)
    with device_guard(v):
        if nc:
            _kda_chunk_prep[(nc, H)](
                q, k, v, g, beta, plan.chunk_start, plan.chunk_len, w, u, qdec, kend, qk, glast,
                H, K, V, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), PREC=prec,
                LOG2_T=block_t.bit_length() - 1, KEY_DIM=K, BLOCK_T=block_t, BLOCK_K=block_k,
                BLOCK_V=block_v_full, num_warps=8 if block_t * max(block_k, block_v_full) > 4096
                else 4)
        if slot_idx.shape[0]:
            _kda_recurrence[(slot_idx.shape[0], H, triton.cdiv(V, block_v))](
                state, w, u, kend, glast, hstart, ckpt, plan.chunk_start, plan.chunk_len,
                plan.chunk_ckpt, plan.req_first_chunk, plan.req_num_chunks, plan.req_slot,
                plan.req_init, plan.req_write, plan.max_chunks, H, K, V, *state.stride(),
                PREC=prec, BLOCK_T=block_t, BLOCK_K=block_k,
                BLOCK_V=block_v, num_warps=8)
        if nc:
            _kda_chunk_output[(nc, H, triton.cdiv(V, block_v))](
                qdec, qk, u, hstart, o, plan.chunk_start, plan.chunk_len, H, K, V, o.stride(0),
                o.stride(1), PREC=prec, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_V=block_v,
                num_warps=4)
    return scan_result(o, ckpt, plan, return_states_at)
