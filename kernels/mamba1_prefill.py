"""Triton varlen selective scan (Mamba1 prefill: Jamba, Mamba, FalconMamba) over state slots;
same contract as `mamba1_ref.mamba1_scan_ref` (the spec).

One program owns one request and BLOCK_D channels with all N states of each, held in registers
for the whole request: token after token, h <- exp(dt' A) h + dt' B x, y = C.h + D x, y *= silu(z).
Each step loads the next token's inputs before it computes the current one (the loads do not
depend on h, so their latency hides behind the update). The loop bound is the batch's longest
request (a scalar); shorter requests run masked steps that leave h unchanged. States after the
tokens named in `return_states_at` go to a checkpoint buffer (`scan_plan.token_ckpt`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scan_plan import build_scan_plan, scan_result, unit_last_stride
from .triton_math import device_guard, silu, softplus


@triton.jit
def _mamba1_scan_kernel(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr,
                        y_ptr, ckpt_ptr, token_ckpt_ptr, req_start_ptr, req_len_ptr, slot_ptr,
                        init_ptr, write_ptr, max_len, n_tokens, d_inner, n_state,
                        s_ss, s_sd, s_sn, s_xt, s_dtt, s_ad, s_an, s_bt, s_ct, s_zt, s_yt,
                        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                        DT_SOFTPLUS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    dmask = d < d_inner
    nmask = n < n_state
    mask2 = dmask[:, None] & nmask[None, :]
    zero_d = d * 0  # scalar conditions join block masks as blocks (the interpreter needs it)
    zero_n = n * 0
    zero2 = zero_d[:, None] + zero_n[None, :]
    slot = tl.load(slot_ptr + r).to(tl.int64)
    start = tl.load(req_start_ptr + r).to(tl.int64)
    length = tl.load(req_len_ptr + r)
    init = tl.load(init_ptr + r)
    A = tl.load(a_ptr + d[:, None] * s_ad + n[None, :] * s_an, mask=mask2, other=0.0).to(tl.float32)
    dt_bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dtb_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    skip = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        skip = tl.load(d_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    h_ptrs = state_ptr + slot * s_ss + d[:, None] * s_sd + n[None, :] * s_sn
    h = tl.load(h_ptrs, mask=mask2 & (zero2 + init != 0), other=0.0).to(tl.float32)

    # inputs of token 0, then each step prefetches token t + 1
    dm, nm = dmask & (zero_d < length), nmask & (zero_n < length)
    x = tl.load(x_ptr + start * s_xt + d, mask=dm, other=0.0)
    dt = tl.load(dt_ptr + start * s_dtt + d, mask=dm, other=0.0)
    Bv = tl.load(b_ptr + start * s_bt + n, mask=nm, other=0.0)
    Cv = tl.load(c_ptr + start * s_ct + n, mask=nm, other=0.0)
    zv = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_Z:
        zv = tl.load(z_ptr + start * s_zt + d, mask=dm, other=0.0).to(tl.float32)
    t = r * 0  # a while loop with a tensor counter: Triton 3.6's interpreter takes no scalar
    while t < max_len:  # kernel argument as a range() bound, and max_len == 1 is a constexpr
        row = start + t
        live_d = dmask & (zero_d + t < length)
        nxt = row + 1
        dm, nm = dmask & (zero_d + t + 1 < length), nmask & (zero_n + t + 1 < length)
        x_n = tl.load(x_ptr + nxt * s_xt + d, mask=dm, other=0.0)
        dt_n = tl.load(dt_ptr + nxt * s_dtt + d, mask=dm, other=0.0)
        B_n = tl.load(b_ptr + nxt * s_bt + n, mask=nm, other=0.0)
        C_n = tl.load(c_ptr + nxt * s_ct + n, mask=nm, other=0.0)
        z_n = zv
        if HAS_Z:
            z_n = tl.load(z_ptr + nxt * s_zt + d, mask=dm, other=0.0).to(tl.float32)

        xf = x.to(tl.float32)
        dtf = dt.to(tl.float32) + dt_bias
        if DT_SOFTPLUS:
            dtf = softplus(dtf)
        dtf = tl.where(live_d, dtf, 0.0)  # a step past the request: exp(0) = 1, no input
        h = tl.exp(dtf[:, None] * A) * h + (dtf * xf)[:, None] * Bv.to(tl.float32)[None, :]
        y = tl.sum(h * Cv.to(tl.float32)[None, :], axis=1) + skip * xf
        if HAS_Z:
            y *= silu(zv)
        tl.store(y_ptr + row * s_yt + d, y.to(y_ptr.dtype.element_ty), mask=live_d)
        # unmasked scalar load (the interpreter takes no scalar mask) at a row inside the batch
        ck = tl.load(token_ckpt_ptr + tl.minimum(row, n_tokens - 1))
        ck = tl.where(t < length, ck, -1).to(tl.int64)
        tl.store(ckpt_ptr + (ck * d_inner + d[:, None]) * n_state + n[None, :],
                 h.to(ckpt_ptr.dtype.element_ty), mask=mask2 & (zero2 + ck >= 0))
        x, dt, Bv, Cv, zv = x_n, dt_n, B_n, C_n, z_n
        t += 1
    write = tl.load(write_ptr + r)
    tl.store(h_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask2 & (zero2 + write != 0))


def mamba1_scan_triton(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                       has_initial_state, dt_softplus=True, return_states_at=None):
    """See mamba1_ref.mamba1_scan_ref. ssm_state [S, d_inner, N] (final states written in place);
    x, dt [T, d_inner]; A [d_inner, N]; B, C [T, N]; D [d_inner] or None; z [T, d_inner] or None;
    dt_bias [d_inner] or None. Returns y [T, d_inner] in x.dtype, or (y, states per request
    [n_pos, d_inner, N] in ssm_state.dtype).
    """
    T, d_inner = x.shape
    N = B.shape[1]
    if tuple(ssm_state.shape[1:]) != (d_inner, N) or tuple(A.shape) != (d_inner, N):
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)} and A {tuple(A.shape)} must be "
                         f"[S, {d_inner}, {N}] and [{d_inner}, {N}] for x [T, {d_inner}] and "
                         f"B [T, {N}]")
    # chunk_size T + 1: one chunk per request; only the per-token checkpoint table is used
    plan = build_scan_plan(query_start_loc, slot_idx, has_initial_state, ssm_state.shape[0], T,
                           T + 1, return_states_at, x.device)
    x, dt, B, C, z = (unit_last_stride(t) for t in (x, dt, B, C, z))
    y = torch.empty((T, d_inner), dtype=x.dtype, device=x.device)
    ckpt = torch.empty((max(plan.num_ckpt, 1), d_inner, N), dtype=ssm_state.dtype,
                       device=x.device)
    block_n = max(2, triton.next_power_of_2(N))
    # 64 channels x 16 states per program: Jamba (d_inner 8192) gets 128 programs per request
    block_d = max(2, min(triton.next_power_of_2(d_inner), max(16, 1024 // block_n)))
    R = slot_idx.shape[0]
    if R:
        with device_guard(x):
            _mamba1_scan_kernel[(R, triton.cdiv(d_inner, block_d))](
                ssm_state, x, dt, A, B, C, D if D is not None else x, z if z is not None else x,
                dt_bias if dt_bias is not None else x, y, ckpt, plan.token_ckpt, plan.req_start,
                plan.req_len, plan.req_slot, plan.req_init, plan.req_write, plan.max_len,
                T, d_inner, N, *ssm_state.stride(), x.stride(0), dt.stride(0), A.stride(0),
                A.stride(1), B.stride(0), C.stride(0), z.stride(0) if z is not None else 0,
                y.stride(0), HAS_D=D is not None, HAS_Z=z is not None,
                HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
                BLOCK_D=block_d, BLOCK_N=block_n)
    return scan_result(y, ckpt, plan, return_states_at)
