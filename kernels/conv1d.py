"""Triton causal depthwise conv1d over state slots: varlen prefill and one-token decode.

One program owns one request and BLOCK_D channels: it walks the request's tokens in BLOCK_T tiles,
taking each tap either from x or (before the request's first token) from the slot's window, and
writes the new window (last k-1 raw inputs) back to the slot after a barrier, so no thread reads
the old window after it was overwritten. Same signatures as conv1d_ref. The token loop is a `for`
when compiled and a `while` under TRITON_INTERPRET (Triton 3.6's interpreter takes no tensor as a
range() bound).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .conv1d_ref import check_conv_args
from .triton_math import device_guard, interpreted, silu


@triton.jit
def _conv1d_kernel(x_ptr, state_ptr, w_ptr, b_ptr, out_ptr, qsl_ptr, slot_ptr, init_ptr, dim,
                   stride_xt, stride_xd, stride_ot, stride_od, stride_ss, stride_sd, stride_sk,
                   stride_wd, stride_wk,
                   VARLEN: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                   KW: tl.constexpr, KPAD: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_D: tl.constexpr, WHILE_LOOP: tl.constexpr):
    r = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    if VARLEN:
        start = tl.load(qsl_ptr + r)
        length = tl.load(qsl_ptr + r + 1) - start
        # window taps below win_lo are zeros: all of them when the request has no history
        win_lo = (1 - tl.load(init_ptr + r)) * KW
    else:
        start = r
        length = 1
        win_lo = 0
    slot = tl.load(slot_ptr + r).to(tl.int64)
    win_ptr = state_ptr + slot * stride_ss + d * stride_sd  # [BLOCK_D], tap 0 of the window

    # the new window: the last KW-1 entries of cat(old window, x_r)
    i = tl.arange(0, KPAD)
    pos = length - (KW - 1) + i
    ivalid = i < KW - 1
    from_x = (ivalid & (pos >= 0))[:, None] & dmask[None, :]
    from_w = (ivalid & (pos < 0) & (KW - 1 + pos >= win_lo))[:, None] & dmask[None, :]
    new_win = tl.load(x_ptr + (start + pos)[:, None] * stride_xt + d[None, :] * stride_xd,
                      mask=from_x, other=0.0).to(tl.float32)
    new_win += tl.load(win_ptr[None, :] + (KW - 1 + pos)[:, None] * stride_sk, mask=from_w,
                       other=0.0).to(tl.float32)

    if HAS_BIAS:
        bias = tl.load(b_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if WHILE_LOOP:  # the interpreter: Triton 3.6's takes no tensor as a range() bound
        t0 = length * 0
        while t0 < length:
            _conv_tile(t0, length, start, d, dmask, bias, x_ptr, w_ptr, win_ptr, out_ptr, win_lo,
                       stride_xt, stride_xd, stride_ot, stride_od, stride_sk, stride_wd, stride_wk,
                       SILU, KW, BLOCK_T, BLOCK_D)
            t0 += BLOCK_T
    else:
        for t0 in range(0, length, BLOCK_T):
            _conv_tile(t0, length, start, d, dmask, bias, x_ptr, w_ptr, win_ptr, out_ptr, win_lo,
                       stride_xt, stride_xd, stride_ot, stride_od, stride_sk, stride_wd, stride_wk,
                       SILU, KW, BLOCK_T, BLOCK_D)
    tl.debug_barrier()  # every read of the old window is done before it is overwritten
    tl.store(win_ptr[None, :] + i[:, None] * stride_sk, new_win.to(state_ptr.dtype.element_ty),
             mask=ivalid[:, None] & dmask[None, :])


@triton.jit
def _conv_tile(t0, length, start, d, dmask, bias, x_ptr, w_ptr, win_ptr, out_ptr, win_lo,
               stride_xt, stride_xd, stride_ot, stride_od, stride_sk, stride_wd, stride_wk,
               SILU: tl.constexpr, KW: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Outputs of tokens t0 .. t0 + BLOCK_T of one request, for BLOCK_D channels."""
    t = t0 + tl.arange(0, BLOCK_T)
    tmask = t < length
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + bias[None, :]
    for j in tl.static_range(KW):
        w_j = tl.load(w_ptr + d * stride_wd + j * stride_wk, mask=dmask, other=0.0)
        rel = t - (KW - 1) + j  # input position of tap j, relative to the request start
        mx = (tmask & (rel >= 0))[:, None] & dmask[None, :]
        mw = (tmask & (rel < 0) & (KW - 1 + rel >= win_lo))[:, None] & dmask[None, :]
        xv = tl.load(x_ptr + (start + rel)[:, None] * stride_xt + d[None, :] * stride_xd,
                     mask=mx, other=0.0).to(tl.float32)
        xv += tl.load(win_ptr[None, :] + (KW - 1 + rel)[:, None] * stride_sk, mask=mw,
                      other=0.0).to(tl.float32)
        acc += xv * w_j.to(tl.float32)[None, :]
    if SILU:
        acc = silu(acc)
    tl.store(out_ptr + (start + t)[:, None] * stride_ot + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])


def _activation_flag(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation {activation!r} is not supported; use 'silu' or None")
    return activation is not None


def _launch(x, conv_state, weight, bias, out, qsl, slot_idx, init, num_reqs, activation, varlen):
    check_conv_args(x, conv_state, weight)
    dim, kw = weight.shape
    block_d = min(triton.next_power_of_2(dim), 128)
    grid = (num_reqs, triton.cdiv(dim, block_d))
    with device_guard(x):
        _conv1d_kernel[grid](
            x, conv_state, weight, bias if bias is not None else weight, out, qsl, slot_idx, init,
            dim, x.stride(0), x.stride(1), out.stride(0), out.stride(1), conv_state.stride(0),
            conv_state.stride(1), conv_state.stride(2), weight.stride(0), weight.stride(1),
            VARLEN=varlen, HAS_BIAS=bias is not None, SILU=_activation_flag(activation), KW=kw,
            KPAD=triton.next_power_of_2(max(kw - 1, 1)), BLOCK_T=16 if varlen else 1,
            BLOCK_D=block_d, WHILE_LOOP=interpreted())
    return out


def causal_conv1d_triton(x, conv_state, weight, bias, query_start_loc, slot_idx, has_initial_state,
                         activation="silu"):
    """Varlen prefill conv; see conv1d_ref.causal_conv1d_ref. x [T, dim] -> [T, dim]."""
    out = torch.empty_like(x)
    if has_initial_state is None:  # as in the reference: every request continues its slot
        init = torch.ones(slot_idx.shape[0], dtype=torch.int32, device=x.device)
    else:
        init = has_initial_state.to(device=x.device, dtype=torch.int32)
    return _launch(x, conv_state, weight, bias, out, query_start_loc, slot_idx, init,
                   slot_idx.shape[0], activation, True)


def conv1d_update_triton(x, conv_state, weight, bias, slot_idx, activation="silu"):
    """One decode token per request; see conv1d_ref.conv1d_update_ref. x [B, dim] -> [B, dim]."""
    out = torch.empty_like(x)
    return _launch(x, conv_state, weight, bias, out, slot_idx, slot_idx, slot_idx,
                   slot_idx.shape[0], activation, False)
