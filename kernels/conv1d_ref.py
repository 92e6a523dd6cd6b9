"""Torch reference for the depthwise causal conv1d of Mamba/GDN/short-conv layers, over state slots.

The conv state of a slot holds the last k-1 raw inputs (pre-activation) of the request, oldest first,
as transformers keeps them; prefill starts from that window and leaves the new one behind.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import request_spans


def check_conv_args(x, conv_state, weight):
    dim, k = weight.shape
    if x.shape[-1] != dim or conv_state.shape[1] != dim or conv_state.shape[2] != k - 1:
        raise ValueError(f"conv shapes disagree: x {tuple(x.shape)}, conv_state "
                         f"{tuple(conv_state.shape)}, weight {tuple(weight.shape)}; expected "
                         f"x [..., {dim}], conv_state [S, {dim}, {k - 1}]")


def conv_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation {activation!r} is not supported; use 'silu' or None")


def causal_conv1d_ref(x, conv_state, weight, bias, query_start_loc, slot_idx, has_initial_state,
                      activation="silu"):
    """Varlen causal depthwise conv starting from each request's conv window.

    x [T, dim] packed tokens; conv_state [S, dim, k-1] pool (updated in place: each slot gets the
    last k-1 inputs of cat(window, x_r)); weight [dim, k]; bias [dim] or None;
    query_start_loc [R+1]; slot_idx [R]; has_initial_state [R] bool (False: window of zeros).
    Returns [T, dim] in x.dtype, computed in fp32.
    """
    check_conv_args(x, conv_state, weight)
    dim, k = weight.shape
    out = torch.empty_like(x)
    w = weight.float().unsqueeze(1)
    b = None if bias is None else bias.float()
    for start, end, slot, init in request_spans(query_start_loc, conv_state.shape[0], slot_idx,
                                                has_initial_state):
        window = conv_state[slot].float() if init else x.new_zeros(dim, k - 1, dtype=torch.float32)
        full = torch.cat([window, x[start:end].float().t()], dim=1)  # [dim, k-1+L]
        y = F.conv1d(full.unsqueeze(0), w, b, groups=dim)[0]  # [dim, L]
        out[start:end] = conv_activation(y, activation).t().to(x.dtype)
        conv_state[slot] = full[:, full.shape[1] - (k - 1):].to(conv_state.dtype)
    return out


def conv1d_update_ref(x, conv_state, weight, bias, slot_idx, activation="silu"):
    """One decode token per request. x [B, dim]; conv_state [S, dim, k-1] (updated in place);
    weight [dim, k]; bias [dim] or None; slot_idx [B]. Returns [B, dim] in x.dtype.

    The windows are gathered, extended by x, convolved (taps summed oldest first, then the
    bias) and the last k-1 columns written back.
    """
    check_conv_args(x, conv_state, weight)
    slots = slot_idx.long()
    full = torch.cat([conv_state[slots].float(), x.float()[:, :, None]], dim=2)  # [B, dim, k]
    w = weight.float()
    y = full[:, :, 0] * w[:, 0]
    for j in range(1, weight.shape[1]):
        y = y + full[:, :, j] * w[:, j]
    if bias is not None:
        y = y + bias.float()
    conv_state[slots] = full[:, :, 1:].to(conv_state.dtype)
    return conv_activation(y, activation).to(x.dtype)
