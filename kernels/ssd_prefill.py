"""Triton varlen chunked SSD (Mamba2 prefill) over state slots; same contract as
`mamba2_ref.mamba2_chunk_scan_ref` (the spec).

Four launches over the chunk list of `scan_plan.py` (chunks never cross a request boundary):
  1. chunk cumsum   per (chunk, head block): dt' = clamp(softplus(dt + bias)) and the running
                    log-decay acum = cumsum(dt' A) inside the chunk;
  2. chunk state    per (chunk, head, P block): the chunk's own contribution to its end state,
                    sum_l exp(acum_end - acum_l) dt'_l x_l B_l^T, one matmul per L tile;
  3. state passing  per (request, head, state block): h <- exp(acum_end) h + chunk state, chunk
                    after chunk from the slot's state; stores each chunk's entering state, the
                    requested checkpoints and the final state back into the slot;
  4. chunk scan     per (chunk, L tile, head, P block): y = exp(acum_l) C_l h_start
                    + sum_{s<=l} (C_l.B_s) exp(acum_l - acum_s) dt'_s x_s, then D x and the z gate.
Triton 3.6's interpreter takes no tensor, nor a scalar kernel argument, as a range() bound: the
chunk-state tile loop has constexpr bounds, the loop over a request's chunks is a `while`, and the
causal tile loop of the chunk scan is a `for` when compiled and a `while` when interpreted.
Matmuls take the inputs' dtype (fp16/bf16) with fp32 accumulation, or exact fp32 (input_precision
"ieee", not tf32) for fp32 inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scan_plan import build_scan_plan, scan_result, unit_last_stride
from .triton_math import device_guard, interpreted, silu, softplus


@triton.jit
def _ssd_chunk_cumsum(dt_ptr, a_ptr, dtb_ptr, chunk_start_ptr, chunk_len_ptr, dtp_ptr, acum_ptr,
                      decay_ptr, n_heads, dt_min, dt_max, s_dtt, s_dth,
                      HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                      HAS_LIMIT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    c = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ls = tl.arange(0, BLOCK_C)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    hmask = hs < n_heads
    mask = (ls[:, None] < length) & hmask[None, :]
    rows = start + ls
    dt = tl.load(dt_ptr + rows[:, None] * s_dtt + hs[None, :] * s_dth, mask=mask,
                 other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dtb_ptr + hs, mask=hmask, other=0.0).to(tl.float32)[None, :]
    if DT_SOFTPLUS:
        dt = softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(mask, dt, 0.0)  # positions past the chunk: no decay, no input
    a = dt * tl.load(a_ptr + hs, mask=hmask, other=0.0).to(tl.float32)[None, :]
    acum = tl.cumsum(a, axis=0)
    offs = rows[:, None] * n_heads + hs[None, :]
    tl.store(dtp_ptr + offs, dt, mask=mask)
    tl.store(acum_ptr + offs, acum, mask=mask)
    tl.store(decay_ptr + c * n_heads + hs, tl.exp(tl.sum(a, axis=0)), mask=hmask)


@triton.jit
def _ssd_chunk_state(x_ptr, b_ptr, dtp_ptr, acum_ptr, chunk_start_ptr, chunk_len_ptr, cstate_ptr,
                     n_heads, head_dim, n_state, heads_per_group, s_xt, s_xh, s_bt, s_bg,
                     PREC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    a_end = tl.load(acum_ptr + (start + length - 1) * n_heads + h)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for l0 in range(0, BLOCK_C, BLOCK_L):  # constexpr bounds (see the module docstring)
        ls = l0 + tl.arange(0, BLOCK_L)
        lmask = ls < length
        rows = start + ls
        acum = tl.load(acum_ptr + rows * n_heads + h, mask=lmask, other=0.0)
        dtp = tl.load(dtp_ptr + rows * n_heads + h, mask=lmask, other=0.0)
        w = tl.where(lmask, tl.exp(a_end - acum) * dtp, 0.0)
        xt = tl.load(x_ptr + rows[:, None] * s_xt + h * s_xh + ps[None, :],
                     mask=lmask[:, None] & (ps[None, :] < head_dim), other=0.0)
        bt = tl.load(b_ptr + rows[:, None] * s_bt + g * s_bg + ns[None, :],
                     mask=lmask[:, None] & (ns[None, :] < n_state), other=0.0)
        xw = (xt.to(tl.float32) * w[:, None]).to(x_ptr.dtype.element_ty)
        acc += tl.dot(tl.trans(xw), bt.to(x_ptr.dtype.element_ty), input_precision=PREC)
    offs = ((c * n_heads + h) * head_dim + ps[:, None]) * n_state + ns[None, :]
    tl.store(cstate_ptr + offs, acc, mask=(ps[:, None] < head_dim) & (ns[None, :] < n_state))


@triton.jit
def _ssd_state_passing(state_ptr, cstate_ptr, decay_ptr, hstart_ptr, ckpt_ptr, chunk_ckpt_ptr,
                       first_ptr, nchunks_ptr, slot_ptr, init_ptr, write_ptr, max_chunks,
                       n_heads, head_dim, n_state, s_ss, s_sh, s_sp, s_sn,
                       BLOCK: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)  # flat (p, n) index of the state
    size = head_dim * n_state
    emask = e < size
    p = e // n_state
    n = e % n_state
    slot = tl.load(slot_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r)
    first = tl.load(first_ptr + r)
    nch = tl.load(nchunks_ptr + r)
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + p * s_sp + n * s_sn
    zero = e * 0  # scalar conditions join block masks as blocks (the interpreter needs it)
    hs = tl.load(s_ptrs, mask=emask & (zero + init != 0), other=0.0).to(tl.float32)
    k = r * 0  # a tensor counter: max_chunks == 1 arrives as a constexpr
    while k < max_chunks:
        active = k < nch
        live = emask & (zero + k < nch)
        # scalar loads go unmasked (the interpreter takes no scalar mask): chunk 0 stands in
        c = tl.where(active, first + k, 0).to(tl.int64)
        offs = (c * n_heads + h) * size + e
        tl.store(hstart_ptr + offs, hs, mask=live)
        decay = tl.where(active, tl.load(decay_ptr + c * n_heads + h), 1.0)
        hs = decay * hs + tl.load(cstate_ptr + offs, mask=live, other=0.0)
        row = tl.where(active, tl.load(chunk_ckpt_ptr + c), -1).to(tl.int64)
        tl.store(ckpt_ptr + (row * n_heads + h) * size + e,
                 hs.to(ckpt_ptr.dtype.element_ty), mask=live & (zero + row >= 0))
        k += 1
    write = tl.load(write_ptr + r)
    tl.store(s_ptrs, hs.to(state_ptr.dtype.element_ty), mask=emask & (zero + write != 0))


@triton.jit
def _ssd_scan_tile(y, s0, c_l, ls, acum_l, start, length, h, g, ps, ns, pmask, nmask, x_ptr,
                   b_ptr, dtp_ptr, acum_ptr, n_heads, s_xt, s_xh, s_bt, s_bg,
                   PREC: tl.constexpr, BLOCK_L: tl.constexpr):
    """y [L, P] plus source tile s0 of the chunk: (C_l.B_s) e^(acum_l - acum_s) dt_s x_s."""
    in_ty = x_ptr.dtype.element_ty
    ss = s0 + tl.arange(0, BLOCK_L)
    smask = ss < length
    srows = start + ss
    acum_s = tl.load(acum_ptr + srows * n_heads + h, mask=smask, other=0.0)
    dt_s = tl.load(dtp_ptr + srows * n_heads + h, mask=smask, other=0.0)
    b_s = tl.load(b_ptr + srows[None, :] * s_bt + g * s_bg + ns[:, None],
                  mask=smask[None, :] & nmask[:, None], other=0.0).to(in_ty)  # [N, S]
    x_s = tl.load(x_ptr + srows[:, None] * s_xt + h * s_xh + ps[None, :],
                  mask=smask[:, None] & pmask[None, :], other=0.0).to(in_ty)
    causal = (ls[:, None] >= ss[None, :]) & smask[None, :]
    seg = tl.where(causal, acum_l[:, None] - acum_s[None, :], 0.0)
    weight = tl.where(causal, tl.exp(seg) * dt_s[None, :], 0.0)
    scores = tl.dot(c_l, b_s, input_precision=PREC) * weight
    return y + tl.dot(scores.to(in_ty), x_s, input_precision=PREC)


@triton.jit
def _ssd_chunk_scan(x_ptr, b_ptr, c_ptr, d_ptr, z_ptr, y_ptr, dtp_ptr, acum_ptr, hstart_ptr,
                    chunk_start_ptr, chunk_len_ptr, l_blocks, n_heads, head_dim,
                    n_state, heads_per_group, s_xt, s_xh, s_bt, s_bg, s_ct, s_cg, s_zt, s_zh,
                    s_yt, s_yh,
                    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, PREC: tl.constexpr,
                    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                    WHILE_LOOP: tl.constexpr):
    c = tl.program_id(0) // l_blocks
    l0 = (tl.program_id(0) % l_blocks) * BLOCK_L
    h = tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    ls = l0 + tl.arange(0, BLOCK_L)
    lmask = ls < length
    pmask = ps < head_dim
    nmask = ns < n_state
    rows = start + ls
    in_ty = x_ptr.dtype.element_ty
    acum_l = tl.load(acum_ptr + rows * n_heads + h, mask=lmask, other=0.0)
    c_l = tl.load(c_ptr + rows[:, None] * s_ct + g * s_cg + ns[None, :],
                  mask=lmask[:, None] & nmask[None, :], other=0.0).to(in_ty)
    h_offs = ((c.to(tl.int64) * n_heads + h) * head_dim + ps[None, :]) * n_state + ns[:, None]
    h_t = tl.load(hstart_ptr + h_offs, mask=pmask[None, :] & nmask[:, None], other=0.0)  # [N, P]
    y = tl.dot(c_l, h_t.to(in_ty), input_precision=PREC) * tl.exp(acum_l)[:, None]
    tile_args = (c_l, ls, acum_l, start, length, h, g, ps, ns, pmask, nmask, x_ptr, b_ptr,
                 dtp_ptr, acum_ptr, n_heads, s_xt, s_xh, s_bt, s_bg)
    if WHILE_LOOP:  # the interpreter (see the module docstring)
        s0 = l0 * 0
        while s0 <= l0:  # tiles after this one are masked by causality
            y = _ssd_scan_tile(y, s0, *tile_args, PREC, BLOCK_L)
            s0 += BLOCK_L
    else:
        for s0 in range(0, l0 + BLOCK_L, BLOCK_L):
            y = _ssd_scan_tile(y, s0, *tile_args, PREC, BLOCK_L)
    x_l = tl.load(x_ptr + rows[:, None] * s_xt + h * s_xh + ps[None, :],
                  mask=lmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)
    if HAS_D:
        y += x_l * tl.load(d_ptr + h).to(tl.float32)
    if HAS_Z:
        zv = tl.load(z_ptr + rows[:, None] * s_zt + h * s_zh + ps[None, :],
                     mask=lmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)
        y *= silu(zv)
    tl.store(y_ptr + rows[:, None] * s_yt + h * s_yh + ps[None, :], y.to(y_ptr.dtype.element_ty),
             mask=lmask[:, None] & pmask[None, :])


def mamba2_chunk_scan_triton(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                             has_initial_state, chunk_size=256, dt_softplus=True,
                             return_states_at=None, dt_limit=None):
    """See mamba2_ref.mamba2_chunk_scan_ref. ssm_state [S, H, P, N] (final states written in
    place); x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N]; D [H] or None; z [T, H, P] or None.
    Returns y [T, H, P] in x.dtype, or (y, states per request [n_pos, H, P, N]).
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G or tuple(ssm_state.shape[1:]) != (H, P, N):
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)} must be [S, {H}, {P}, {N}] and "
                         f"{H} heads a multiple of {G} B/C groups")
    plan = build_scan_plan(query_start_loc, slot_idx, has_initial_state, ssm_state.shape[0], T,
                           chunk_size, return_states_at, x.device)
    x, B, C, z = (unit_last_stride(t) for t in (x, B, C, z))
    dev, f32 = x.device, torch.float32
    y = torch.empty((T, H, P), dtype=x.dtype, device=dev)
    ckpt = torch.empty((max(plan.num_ckpt, 1), H, P, N), dtype=ssm_state.dtype, device=dev)
    nc = plan.num_chunks
    dtp = torch.empty((T, H), dtype=f32, device=dev)
    acum = torch.empty((T, H), dtype=f32, device=dev)
    decay = torch.empty((max(nc, 1), H), dtype=f32, device=dev)
    cstate = torch.empty((max(nc, 1), H, P, N), dtype=f32, device=dev)
    hstart = torch.empty_like(cstate)
    ieee_fp32 = x.dtype == torch.float32
    prec = "ieee" if ieee_fp32 else "tf32"  # tf32: ignored for fp16/bf16
    block_c = max(16, triton.next_power_of_2(chunk_size))
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_c))
    big = 32 if ieee_fp32 else 64  # exact fp32 operands take twice the registers: half tiles
    block_l = min(big, block_c)
    block_n = max(16, triton.next_power_of_2(N))
    block_p = max(16, min(big, triton.next_power_of_2(P)))
    scan_warps = 4 if block_n <= 128 else 8  # N = 256: C and B tiles spill 4 warps' registers
    block_e = min(1024, triton.next_power_of_2(P * N))
    lo, hi = (0.0, float("inf")) if dt_limit is None else (float(dt_limit[0]), float(dt_limit[1]))
    with device_guard(x):
        if nc:
            _ssd_chunk_cumsum[(nc, triton.cdiv(H, block_h))](
                dt, A, dt_bias if dt_bias is not None else A, plan.chunk_start, plan.chunk_len,
                dtp, acum, decay, H, lo, hi, dt.stride(0), dt.stride(1),
                HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
                HAS_LIMIT=dt_limit is not None, BLOCK_C=block_c, BLOCK_H=block_h)
            _ssd_chunk_state[(nc, H, triton.cdiv(P, block_p))](
                x, B, dtp, acum, plan.chunk_start, plan.chunk_len, cstate, H, P, N, H // G,
                x.stride(0), x.stride(1), B.stride(0), B.stride(1),
                PREC=prec, BLOCK_C=block_c, BLOCK_L=block_l, BLOCK_P=block_p, BLOCK_N=block_n)
        if slot_idx.shape[0]:
            _ssd_state_passing[(slot_idx.shape[0], H, triton.cdiv(P * N, block_e))](
                ssm_state, cstate, decay, hstart, ckpt, plan.chunk_ckpt, plan.req_first_chunk,
                plan.req_num_chunks, plan.req_slot, plan.req_init, plan.req_write,
                plan.max_chunks, H, P, N, *ssm_state.stride(), BLOCK=block_e)
        if nc:
            l_blocks = triton.cdiv(chunk_size, block_l)
            _ssd_chunk_scan[(nc * l_blocks, H, triton.cdiv(P, block_p))](
                x, B, C, D if D is not None else A, z if z is not None else x, y, dtp, acum,
                hstart, plan.chunk_start, plan.chunk_len, l_blocks, H, P, N, H // G,
                x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
                z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
                y.stride(0), y.stride(1), HAS_D=D is not None, HAS_Z=z is not None, PREC=prec,
                BLOCK_L=block_l, BLOCK_P=block_p, BLOCK_N=block_n, WHILE_LOOP=interpreted(),
                num_warps=scan_warps)
    return scan_result(y, ckpt, plan, return_states_at)
