"""Torch reference for RWKV-4's WKV recurrence (the time-mix "linear attention") over state slots.

Per channel, with w = -exp(time_decay) and u = time_first, the state is (num, den, max): the
numerator and denominator of a softmax-like average of past values, both scaled by exp(-max) so
no exponent overflows. For a token with key k and value v:
    o = max(max, u + k);  wkv = (exp(max - o) num + exp(u + k - o) v) / (exp(max - o) den + exp(u + k - o))
    m = max(max + w, k);  num = exp(max + w - m) num + exp(k - m) v;  den likewise with 1;  max = m
exactly transformers' `rwkv_linear_attention_cpu`, step by step and in its order, so results agree
to the last bit in float32. A request without an initial state starts from num = den = 0 and
max = -1e30 (transformers' generation state; its -1e38 without a cache gives the same numbers:
exp of either is 0). The state stays float32; outputs come back in value.dtype.
"""
from __future__ import annotations

import torch

from .varlen import request_spans

INITIAL_MAX = -1e30


def _check(state, key, value, time_decay, time_first):
    """ValueError naming the input whose width differs from the pool's [S, 3, C] (nothing changed)."""
    if state.dim() != 3 or state.shape[1] != 3:
        raise ValueError(f"the RWKV state pool has shape {tuple(state.shape)}; expected [slots, 3, channels] "
                         f"(numerator, denominator, running max)")
    C = state.shape[-1]
    for name, t in (("key", key), ("value", value), ("time_decay", time_decay), ("time_first", time_first)):
        if t.shape[-1] != C:
            raise ValueError(f"{name} has width {t.shape[-1]} but the RWKV state pool has {C} channels")


def _step(num, den, mx, k, v, w, u):
    """One token for a batch of states: (wkv, num, den, max), all float32 [B, C]."""
    out_max = torch.maximum(mx, k + u)
    e1, e2 = torch.exp(mx - out_max), torch.exp(k + u - out_max)
    wkv = (e1 * num + e2 * v) / (e1 * den + e2)
    new_max = torch.maximum(mx + w, k)
    e1, e2 = torch.exp(mx + w - new_max), torch.exp(k - new_max)
    return wkv, e1 * num + e2 * v, e1 * den + e2, new_max


def rwkv4_state_update_ref(state, key, value, time_decay, time_first, slot_idx):
    """One decode token per request.

    state [S, 3, C] float32 pool (num, den, max), updated in place at `slot_idx [B]`; key, value
    [B, C]; time_decay, time_first [C] (the raw parameters: the decay is -exp(time_decay)).
    Returns wkv [B, C] in value.dtype.
    """
    _check(state, key, value, time_decay, time_first)
    slots = slot_idx.long()
    s = state[slots]
    w = -torch.exp(time_decay.float())
    wkv, num, den, mx = _step(s[:, 0], s[:, 1], s[:, 2], key.float(), value.float(), w, time_first.float())
    state[slots] = torch.stack([num, den, mx], dim=1)
    return wkv.to(value.dtype)


def rwkv4_scan_ref(state, key, value, time_decay, time_first, query_start_loc, slot_idx, has_initial_state):
    """Varlen WKV over each request's tokens from its slot's state, the final state left in the slot.

    state [S, 3, C] float32 pool; key, value [T, C] packed; query_start_loc [R+1]; slot_idx [R];
    has_initial_state [R] bool (False: the request starts at position 0; the slot's old contents
    are ignored). The requests advance together, one token position per step. Returns wkv [T, C]
    in value.dtype.
    """
    _check(state, key, value, time_decay, time_first)
    spans = request_spans(query_start_loc, state.shape[0], slot_idx, has_initial_state)
    live = [(a, b, slot, init) for a, b, slot, init in spans if b > a]
    out = torch.empty(key.shape, dtype=torch.float32, device=key.device)
    if not live:
        return out.to(value.dtype)
    dev = key.device
    slots = torch.tensor([s for _, _, s, _ in live], dtype=torch.long, device=dev)
    init = torch.tensor([i for *_, i in live], dtype=torch.bool, device=dev)[:, None]
    s = state[slots]
    num = torch.where(init, s[:, 0], torch.zeros_like(s[:, 0]))
    den = torch.where(init, s[:, 1], torch.zeros_like(s[:, 1]))
    mx = torch.where(init, s[:, 2], torch.full_like(s[:, 2], INITIAL_MAX))
    w, u = -torch.exp(time_decay.float()), time_first.float()
    k, v = key.float(), value.float()
    starts = torch.tensor([a for a, *_ in live], dtype=torch.long, device=dev)
    lengths = [b - a for a, b, *_ in live]
    for t in range(max(lengths)):
        rows = [r for r, n in enumerate(lengths) if n > t]  # requests that still have a token at t
        if len(rows) == len(live):
            sel, tok = slice(None), starts + t
        else:
            sel = torch.tensor(rows, dtype=torch.long, device=dev)
            tok = starts[sel] + t
        wkv, n_, d_, m_ = _step(num[sel], den[sel], mx[sel], k[tok], v[tok], w, u)
        out[tok] = wkv
        num[sel], den[sel], mx[sel] = n_, d_, m_
    state[slots] = torch.stack([num, den, mx], dim=1).to(state.dtype)
    return out.to(value.dtype)
