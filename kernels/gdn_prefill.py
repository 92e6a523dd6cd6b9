"""Triton varlen chunked gated delta rule (GDN prefill, Qwen3-Next / Qwen3.5) over state slots;
same contract as `gdn_ref.gdn_chunk_scan_ref` (the spec, whose docstring derives the algebra).

Chunked WY form over the chunk list of `scan_plan.py` (chunks never cross a request boundary),
three launches:
  1. prep        per (chunk, value head): the running log-decay G = cumsum(g), the strictly
                 lower A_ij = beta_i e^(G_i - G_j) k_i.k_j and T = (I + A)^-1 by forward
                 substitution, then w = T (beta e^G k) [L, K] and u0 = T (beta v) [L, V];
  2. recurrence  per (request, value head, V block), chunk after chunk from the slot's state S:
                 u = u0 - w S, S <- e^(G_last) S + (e^(G_last - G) k)^T u; stores each chunk's
                 entering state, u, the requested checkpoints and the final state into the slot;
  3. output      per (chunk, value head, V block): o = (e^G q) S_start + (q k^T . e^(G_i - G_j),
                 j <= i) u.
q and k are L2-normalised (eps 1e-6 inside the rsqrt) and q scaled by torch before the launches;
the H q/k heads serve HV // H consecutive value heads. The inverse is a product of log2(L)
matmuls (I + A is unit lower triangular, so A is nilpotent), not an L-step substitution. Column
loops have constexpr bounds and the chunk loop is a `while`: Triton 3.6's interpreter takes no
tensor, nor a scalar kernel argument, as a range() bound. Matmuls take fp16/bf16 operands with fp32
accumulation for half inputs, exact fp32 products for fp32 inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scan_plan import build_scan_plan, matmul_precision, scan_result, unit_last_stride
from .triton_math import device_guard


@triton.jit
def _gdn_chunk_prep(k_ptr, v_ptr, g_ptr, beta_ptr, chunk_start_ptr, chunk_len_ptr, w_ptr, u_ptr,
                    gcum_ptr, n_vheads, rep, key_dim, value_dim, s_kt, s_kh, s_vt, s_vh, s_gt,
                    s_gh, s_bt, s_bh,
                    PREC: tl.constexpr, LOG2_T: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_KV: tl.constexpr):
    # K and V are walked in BLOCK_KV column tiles: whole [L, 128] rows in fp32 spill registers
    c = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    ts = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_KV)
    tmask = ts < length
    rows = start + ts
    in_ty = v_ptr.dtype.element_ty
    k_rows = k_ptr + rows[:, None] * s_kt + (hv // rep) * s_kh
    gg = tl.load(g_ptr + rows * s_gt + hv * s_gh, mask=tmask, other=0.0).to(tl.float32)
    bb = tl.load(beta_ptr + rows * s_bt + hv * s_bh, mask=tmask, other=0.0).to(tl.float32)
    G = tl.cumsum(gg, axis=0)
    tl.store(gcum_ptr + rows * n_vheads + hv, G, mask=tmask)
    kkt = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, BLOCK_K, BLOCK_KV):  # constexpr bounds (see the module docstring)
        kt = tl.load(k_rows + k0 + cols[None, :],
                     mask=tmask[:, None] & (k0 + cols[None, :] < key_dim), other=0.0)
        kkt += tl.dot(kt, tl.trans(kt), input_precision=PREC)
    strict = ts[:, None] > ts[None, :]
    # M = -A (strictly lower, so nilpotent): (I + A)^-1 = (I + M)(I + M^2)(I + M^4)...
    M = tl.where(strict, -bb[:, None] * tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0))
                 * kkt, 0.0)
    inv = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0) + M
    for _ in tl.static_range(1, LOG2_T):  # in the operand dtype: exact fp32 dots spill here
        M = tl.dot(M.to(in_ty), M.to(in_ty), input_precision=PREC)
        inv = inv + tl.dot(inv.to(in_ty), M.to(in_ty), input_precision=PREC)
    inv_in = inv.to(in_ty)
    k_coef = bb * tl.exp(G)
    for k0 in range(0, BLOCK_K, BLOCK_KV):
        kmask = tmask[:, None] & (k0 + cols[None, :] < key_dim)
        kt = tl.load(k_rows + k0 + cols[None, :], mask=kmask, other=0.0).to(tl.float32)
        w = tl.dot(inv_in, (kt * k_coef[:, None]).to(in_ty), input_precision=PREC)
        tl.store(w_ptr + (rows[:, None] * n_vheads + hv) * key_dim + k0 + cols[None, :], w,
                 mask=kmask)
    for v0 in range(0, BLOCK_V, BLOCK_KV):
        vmask = tmask[:, None] & (v0 + cols[None, :] < value_dim)
        vt = tl.load(v_ptr + rows[:, None] * s_vt + hv * s_vh + v0 + cols[None, :], mask=vmask,
                     other=0.0).to(tl.float32)
        u = tl.dot(inv_in, (vt * bb[:, None]).to(in_ty), input_precision=PREC)
        tl.store(u_ptr + (rows[:, None] * n_vheads + hv) * value_dim + v0 + cols[None, :], u,
                 mask=vmask)


@triton.jit
def _gdn_recurrence(state_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, hstart_ptr, ckpt_ptr,
                    chunk_start_ptr, chunk_len_ptr, chunk_ckpt_ptr, first_ptr, nchunks_ptr,
                    slot_ptr, init_ptr, write_ptr, max_chunks, n_vheads, rep, key_dim, value_dim,
                    s_ss, s_sh, s_sk, s_sv, s_kt, s_kh,
                    PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    hv = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, BLOCK_T)
    vmask = vs < value_dim
    smask = (ks[:, None] < key_dim) & vmask[None, :]
    zero = ks[:, None] * 0 + vs[None, :] * 0  # scalar conditions join block masks as blocks
    slot = tl.load(slot_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r)
    first = tl.load(first_ptr + r)
    nch = tl.load(nchunks_ptr + r)
    in_ty = k_ptr.dtype.element_ty
    s_ptrs = state_ptr + slot * s_ss + hv * s_sh + ks[:, None] * s_sk + vs[None, :] * s_sv
    S = tl.load(s_ptrs, mask=smask & (zero + init != 0), other=0.0).to(tl.float32)
    size = key_dim * value_dim
    i = r * 0  # a tensor counter: max_chunks == 1 arrives as a constexpr
    while i < max_chunks:
        active = i < nch
        c = tl.where(active, first + i, 0).to(tl.int64)
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        length = tl.where(active, tl.load(chunk_len_ptr + c), 0)  # 0: every load below masked
        tmask = ts < length
        rows = start + ts
        live = smask & (zero + i < nch)
        s_offs = (c * n_vheads + hv) * size + ks[:, None] * value_dim + vs[None, :]
        tl.store(hstart_ptr + s_offs, S, mask=live)
        # [L, K] operands stay in the operand dtype (fp32 copies of both spill at K = 256)
        kk = tl.load(k_ptr + rows[:, None] * s_kt + (hv // rep) * s_kh + ks[None, :],
                     mask=tmask[:, None] & (ks[None, :] < key_dim), other=0.0)
        w = tl.load(w_ptr + (rows[:, None] * n_vheads + hv) * key_dim + ks[None, :],
                    mask=tmask[:, None] & (ks[None, :] < key_dim), other=0.0).to(in_ty)
        u_ptrs = u_ptr + (rows[:, None] * n_vheads + hv) * value_dim + vs[None, :]
        umask = tmask[:, None] & vmask[None, :]
        G = tl.load(gcum_ptr + rows * n_vheads + hv, mask=tmask, other=0.0)
        u = tl.load(u_ptrs, mask=umask, other=0.0) - tl.dot(w, S.to(in_ty),
                                                            input_precision=PREC)
        tl.store(u_ptrs, u, mask=umask)  # u0 becomes the corrected u the output kernel reads
        g_last = tl.sum(tl.where(ts == length - 1, G, 0.0), axis=0)
        # sum_j e^(G_last - G_j) k_j u_j^T: the decay goes on u's small [L, BV] tile, not on k
        u_end = u * tl.where(tmask, tl.exp(g_last - G), 0.0)[:, None]
        S = tl.exp(g_last) * S + tl.dot(tl.trans(kk), u_end.to(in_ty), input_precision=PREC)
        row = tl.where(active, tl.load(chunk_ckpt_ptr + c), -1).to(tl.int64)
        tl.store(ckpt_ptr + (row * n_vheads + hv) * size + ks[:, None] * value_dim + vs[None, :],
                 S.to(ckpt_ptr.dtype.element_ty), mask=live & (zero + row >= 0))
        i += 1
    write = tl.load(write_ptr + r)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask & (zero + write != 0))


@triton.jit
def _gdn_chunk_output(q_ptr, k_ptr, u_ptr, gcum_ptr, hstart_ptr, o_ptr, chunk_start_ptr,
                      chunk_len_ptr, n_vheads, rep, key_dim, value_dim, s_qt, s_qh, s_kt,
                      s_kh, s_ot, s_oh,
                      PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    c = tl.program_id(0)
    hv = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, BLOCK_T)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    tmask = ts < length
    vmask = vs < value_dim
    rows = start + ts
    in_ty = k_ptr.dtype.element_ty
    kmask = tmask[:, None] & (ks[None, :] < key_dim)
    qq = tl.load(q_ptr + rows[:, None] * s_qt + (hv // rep) * s_qh + ks[None, :], mask=kmask,
                 other=0.0).to(tl.float32)
    kk = tl.load(k_ptr + rows[:, None] * s_kt + (hv // rep) * s_kh + ks[None, :], mask=kmask,
                 other=0.0).to(tl.float32)
    G = tl.load(gcum_ptr + rows * n_vheads + hv, mask=tmask, other=0.0)
    u = tl.load(u_ptr + (rows[:, None] * n_vheads + hv) * value_dim + vs[None, :],
                mask=tmask[:, None] & vmask[None, :], other=0.0)
    S = tl.load(hstart_ptr + (c.to(tl.int64) * n_vheads + hv) * key_dim * value_dim
                + ks[:, None] * value_dim + vs[None, :],
                mask=(ks[:, None] < key_dim) & vmask[None, :], other=0.0)
    causal = ts[:, None] >= ts[None, :]
    pair = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    attn = tl.dot(qq.to(in_ty), tl.trans(kk).to(in_ty), input_precision=PREC) * pair
    o = tl.dot((qq * tl.exp(G)[:, None]).to(in_ty), S.to(in_ty), input_precision=PREC)
    o += tl.dot(attn.to(in_ty), u.to(in_ty), input_precision=PREC)
    tl.store(o_ptr + rows[:, None] * s_ot + hv * s_oh + vs[None, :], o.to(o_ptr.dtype.element_ty),
             mask=tmask[:, None] & vmask[None, :])


def _normalized(q, k, scale, use_qk_l2norm, dtype):
    """q, k [T, H, K] -> L2-normalised (eps 1e-6 inside the rsqrt) in fp32, q scaled, as `dtype`:
    the matmul operand dtype of every kernel here."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return (q * scale).to(dtype), k.to(dtype)


def gdn_chunk_scan_triton(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state,
                          scale=None, use_qk_l2norm=True, chunk_size=64, return_states_at=None):
    """See gdn_ref.gdn_chunk_scan_ref. state [S, HV, K, V] (final states written in place);
    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]. Returns o [T, HV, V] in v.dtype, or
    (o, states per request [n_pos, HV, K, V] in state.dtype).
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if HV % H or tuple(state.shape[1:]) != (HV, K, V) or tuple(k.shape) != (T, H, K):
        raise ValueError(f"state {tuple(state.shape)} must be [S, {HV}, {K}, {V}], k "
                         f"{tuple(k.shape)} must match q {tuple(q.shape)}, and {HV} value heads "
                         f"a multiple of {H} q/k heads")
    plan = build_scan_plan(query_start_loc, slot_idx, has_initial_state, state.shape[0], T,
                           chunk_size, return_states_at, v.device)
    v = unit_last_stride(v)
    q, k = _normalized(q, k, K ** -0.5 if scale is None else float(scale), use_qk_l2norm, v.dtype)
    dev, f32 = v.device, torch.float32
    o = torch.empty((T, HV, V), dtype=v.dtype, device=dev)
    w = torch.empty((T, HV, K), dtype=f32, device=dev)
    u = torch.empty((T, HV, V), dtype=f32, device=dev)
    gcum = torch.empty((T, HV), dtype=f32, device=dev)
    nc = plan.num_chunks
    hstart = torch.empty((max(nc, 1), HV, K, V), dtype=f32, device=dev)
    ckpt = torch.empty((max(plan.num_ckpt, 1), HV, K, V), dtype=state.dtype, device=dev)
    prec = matmul_precision(v.dtype)
    block_t = max(16, triton.next_power_of_2(chunk_size))
    block_k = max(16, triton.next_power_of_2(K))
    block_v_full = max(16, triton.next_power_of_2(V))
    block_v = min(block_v_full, 64 if block_k <= 128 else 32)  # S [K, BV] fp32 in registers
    rep = HV // H
    with device_guard(v):
        if nc:
            _gdn_chunk_prep[(nc, HV)](
                k, v, g, beta, plan.chunk_start, plan.chunk_len, w, u, gcum, HV, rep, K, V,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
                beta.stride(0), beta.stride(1), PREC=prec, LOG2_T=block_t.bit_length() - 1,
                BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_V=block_v_full,
                BLOCK_KV=min(64, max(block_k, block_v_full)), num_warps=8)
        if slot_idx.shape[0]:
            _gdn_recurrence[(slot_idx.shape[0], HV, triton.cdiv(V, block_v))](
                state, k, w, u, gcum, hstart, ckpt, plan.chunk_start, plan.chunk_len,
                plan.chunk_ckpt, plan.req_first_chunk, plan.req_num_chunks, plan.req_slot,
                plan.req_init, plan.req_write, plan.max_chunks, HV, rep, K, V, *state.stride(),
                k.stride(0), k.stride(1), PREC=prec, BLOCK_T=block_t, BLOCK_K=block_k,
                BLOCK_V=block_v, num_warps=8)
        if nc:
            _gdn_chunk_output[(nc, HV, triton.cdiv(V, block_v))](
                q, k, u, gcum, hstart, o, plan.chunk_start, plan.chunk_len, HV, rep, K, V,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
                PREC=prec, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=8)
    return scan_result(o, ckpt, plan, return_states_at)
