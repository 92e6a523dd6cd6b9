"""Fast torch paths for the depthwise causal conv on CPU: same contracts as
`conv1d_ref.causal_conv1d_ref` / `conv1d_update_ref` (the spec).

Prefill: every request of the call at once. Each request's conv window (k-1 rows, or zeros) is
stitched in front of its tokens in one token-major buffer of T + R (k-1) rows; the conv is then
k shifted multiply-adds over the whole buffer (no transpose, no loop over requests), and the
rows that straddle two requests are dropped. The new windows are the last k-1 rows of each
request's segment, written back in one indexed copy. For fp32 the C kernel
(mamba2_prefill_native.py) does all of it, silu included, in one pass over the tokens instead.
Decode: the windows are shifted where they live over each run of consecutive slots (see
slot_rows.py). Taps are summed oldest first, then the bias, in fp32.
Checked against the reference in tests/kernels/test_causal_conv_cpu.py.
"""
from __future__ import annotations

import torch

from .conv1d_ref import conv_activation, check_conv_args
from . import mamba2_prefill_native as prefill_native
from .mamba2_native import conv1d_update_native
from .slot_rows import update_slot_rows
from .varlen import request_spans


def causal_conv1d_cpu(x, conv_state, weight, bias, query_start_loc, slot_idx, has_initial_state,
                      activation="silu"):
    """x [T, dim] packed tokens; conv_state [S, dim, k-1] (updated in place); weight [dim, k];
    bias [dim] or None; query_start_loc [R+1]; slot_idx [R]; has_initial_state [R] bool.
    Returns [T, dim] in x.dtype."""
    check_conv_args(x, conv_state, weight)
    spans = request_spans(query_start_loc, conv_state.shape[0], slot_idx, has_initial_state)
    T, dim = x.shape
    k = weight.shape[1]
    if not spans:
        return torch.empty_like(x)
    if spans[0][0] == 0 and spans[-1][1] == T and activation in (None, "silu", "swish") \
            and conv_state.is_contiguous() and prefill_native.usable(x, conv_state, weight, bias):
        return prefill_native.causal_conv(x, conv_state, weight, bias, spans, activation)
    R, w = len(spans), k - 1
    slots = torch.tensor([s for _, _, s, _ in spans], device=x.device)
    # segment r = rows [start_r + r w, end_r + (r + 1) w): its window, then its tokens
    token_rows = torch.cat([torch.arange(s + r * w + w, e + r * w + w) for r, (s, e, _, _)
                            in enumerate(spans)]).to(x.device)
    buf = torch.empty(T + R * w, dim, dtype=torch.float32, device=x.device)
    buf.index_copy_(0, token_rows, x.float())
    if w:
        heads = torch.tensor([s + r * w for r, (s, _, _, _) in enumerate(spans)], device=x.device)
        win_rows = (heads[:, None] + torch.arange(w, device=x.device)).reshape(-1)
        windows = conv_state.index_select(0, slots).float().transpose(1, 2)  # [R, w, dim]
        init = torch.tensor([i for *_, i in spans], device=x.device)
        windows = torch.where(init.view(R, 1, 1), windows, torch.zeros((), device=x.device))
        buf.index_copy_(0, win_rows, windows.reshape(R * w, dim))
    wf = weight.float()
    n = buf.shape[0] - w  # row i of y: the conv ending at buffer row i + w
    y = buf[:n] * wf[:, 0]
    for j in range(1, k):
        y.addcmul_(buf[j:j + n], wf[:, j])
    if bias is not None:
        y.add_(bias.float())
    out = conv_activation(y.index_select(0, token_rows - w), activation).to(x.dtype)
    if w:
        tails = torch.tensor([e + r * w for r, (_, e, _, _) in enumerate(spans)], device=x.device)
        last = buf.index_select(0, (tails[:, None] + torch.arange(w, device=x.device)).reshape(-1))
        conv_state.index_copy_(0, slots, last.view(R, w, dim).transpose(1, 2).to(conv_state.dtype))
    return out


def conv1d_update_cpu(x, conv_state, weight, bias, slot_idx, activation="silu"):
    """x [B, dim] one token per request; conv_state [S, dim, k-1] (updated in place);
    weight [dim, k]; bias [dim] or None; slot_idx [B]. Returns [B, dim] in x.dtype.
    The C kernel (mamba2_native.py) runs instead where it can; this torch path otherwise."""
    check_conv_args(x, conv_state, weight)
    y = conv1d_update_native(x, conv_state, weight, bias, slot_idx, activation)
    if y is not None:
        return y.to(x.dtype)
    k = weight.shape[1]
    w = weight.float()

    def update(win, xr):
        xf = xr.float()
        y = xf * w[:, k - 1] if k == 1 else win[:, :, 0] * w[:, 0]
        for j in range(1, k):
            y.addcmul_(win[:, :, j] if j < k - 1 else xf, w[:, j])
        if bias is not None:
            y.add_(bias.float())
        for j in range(k - 2):  # the window moves left by one, column by column (no overlapping copy)
            win[:, :, j].copy_(win[:, :, j + 1])
        if k > 1:
            win[:, :, k - 2].copy_(xf)
        return y

    y = update_slot_rows(conv_state, slot_idx.long(), (x,), update)
    return conv_activation(y, activation).to(x.dtype)
