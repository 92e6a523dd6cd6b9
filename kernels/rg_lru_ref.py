"""Torch reference for the RG-LRU (Griffin / RecurrentGemma's real-gated linear recurrent unit)
over state slots.

Per channel, with input gate i_t and recurrence gate r_t (both already through a sigmoid) and the
learned `recurrent_param` c:
    log a_t = -8 r_t softplus(c) ;  a_t = exp(log a_t)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t) ;  y_t = h_t
At a sequence's first token (position 0) the state resets: a = 0 and the sqrt(1 - a^2)
normalisation is skipped, so h_0 = i_0 x_0 (transformers' `reset`). Here that is the first token
of a request without an initial state. The state stays float32; outputs come back in x.dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import check_positions_arg, request_spans, scan_requests


def _decay_and_input(x, input_gate, recurrent_gate, recurrent_param, reset=None):
    """(a [T, W], normalised input [T, W]), fp32; `reset` [T] bool marks position-0 tokens."""
    log_a = -8.0 * recurrent_gate.float() * F.softplus(recurrent_param.float())
    a = torch.exp(log_a)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
    if reset is not None:
        r = reset[:, None]
        a = torch.where(r, torch.zeros_like(a), a)
        multiplier = torch.where(r, torch.ones_like(multiplier), multiplier)
    return a, x.float() * input_gate.float() * multiplier


def check_widths(state, x, input_gate, recurrent_gate, recurrent_param):
    """ValueError naming the input whose width differs from the pool's [S, W] (nothing changed)."""
    W = state.shape[-1]
    for name, t in (("x", x), ("input_gate", input_gate), ("recurrent_gate", recurrent_gate)):
        if t.shape[-1] != W:
            raise ValueError(f"{name} has width {t.shape[-1]} but the RG-LRU state pool has {W}")
    if tuple(recurrent_param.shape) != (W,):
        raise ValueError(f"recurrent_param has shape {tuple(recurrent_param.shape)}; expected ({W},)")


def rg_lru_state_update_ref(state, x, input_gate, recurrent_gate, recurrent_param, slot_idx):
    """One decode token per request (never a position-0 token).

    state [S, W] pool, float32, updated in place at `slot_idx [B]`; x, input_gate, recurrent_gate
    [B, W]; recurrent_param [W]. Returns y [B, W] in x.dtype (y is the new state).
    """
    check_widths(state, x, input_gate, recurrent_gate, recurrent_param)
    slots = slot_idx.long()
    a, xn = _decay_and_input(x, input_gate, recurrent_gate, recurrent_param)
    h = a * state[slots].float() + xn
    state[slots] = h.to(state.dtype)
    return h.to(x.dtype)


def rg_lru_scan_ref(state, x, input_gate, recurrent_gate, recurrent_param, query_start_loc,
                    slot_idx, has_initial_state, return_states_at=None):
    """Varlen RG-LRU scan from each slot's state, leaving the final state in the slot.

    state [S, W] float32 pool; x, input_gate, recurrent_gate [T, W]; recurrent_param [W];
    query_start_loc [R+1]; slot_idx [R]; has_initial_state [R] bool (False: the request starts at
    position 0 — its first token resets the state, the slot's old contents are ignored).
    return_states_at: None, or per request a list of positions 1..len (token counts from the
    request's start in this call). Returns y [T, W] in x.dtype, or (y, states) with states a list
    per request of [n_pos, W] tensors in state.dtype.
    """
    check_widths(state, x, input_gate, recurrent_gate, recurrent_param)
    spans = request_spans(query_start_loc, state.shape[0], slot_idx, has_initial_state)
    check_positions_arg(return_states_at, len(spans))
    reset = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    for start, end, _, init in spans:
        if end > start and not init:
            reset[start] = True
    a, xn = _decay_and_input(x, input_gate, recurrent_gate, recurrent_param, reset)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def piece(h, lo, hi):
        for t in range(lo, hi):
            h = a[t] * h + xn[t]
            y[t] = h
        return h

    states = scan_requests(state, spans, return_states_at, piece)
    out = y.to(x.dtype)
    return out if return_states_at is None else (out, states)
