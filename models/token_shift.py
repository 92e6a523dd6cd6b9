"""The last few inputs of each request, for layers that look a fixed number of tokens back
(RWKV's token shift, Zaya's q/k convolution and delayed values).

A slot keeps the request's last K inputs of the layer (`window [S, C, K]`, oldest first); a
request resumes from them, and one that starts at position 0 sees `initial` (zeros by default)
instead, never its slot's old contents. Every token of a packed step gets its K predecessors at
once through one index (no host sync, so decode steps can be captured in a CUDA graph).
A request that verifies a draft (`ForwardBatch.verify_slots`) leaves its window after each of its
tokens in that token's slot and its live slot as it was (slot_split.py says why).
"""
from __future__ import annotations

from typing import Optional

import torch

from .forward_batch import ForwardBatch


def lagged_inputs(x: torch.Tensor, window: torch.Tensor, batch: ForwardBatch,
                  initial: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, C] packed -> [T, C, K + 1]: per token its request's K previous inputs, oldest first,
    then the token itself. window [S, C, K] is the layer's pool (a view of one is fine), read at
    `batch.state_slots` and left holding each request's last K inputs; initial [C] (or None for
    zeros) stands in for inputs before position 0."""
    qsl, slots, init = batch.query_start_loc.long(), batch.state_slots.long(), batch.has_initial_state
    if batch.query_lens_cpu and min(batch.query_lens_cpu) == 0:  # requests without tokens this step
        keep = torch.tensor([q > 0 for q in batch.query_lens_cpu], device=x.device)
        qsl = torch.cat([qsl[:1], qsl[1:][keep]])
        slots, init = slots[keep], init[keep]
    T, C = x.shape
    R, K = slots.shape[0], window.shape[-1]
    saved = window[slots].to(x.dtype)  # [R, C, K]
    fresh = torch.zeros_like(saved) if initial is None else initial.to(x.dtype)[None, :, None].expand_as(saved)
    before = torch.where(init[:, None, None], saved, fresh)
    t = torch.arange(T, device=x.device)
    req = torch.searchsorted(qsl[1:], t, right=True)  # each token's request
    lags = torch.arange(K, 0, -1, device=x.device)  # K, ..., 1: oldest first
    src = (t - qsl[req])[:, None] - lags  # position inside this step's chunk; < 0: before it
    # rows of [before of every request, time-major | x]
    rows = torch.where(src >= 0, R * K + t[:, None] - lags, req[:, None] * K + K + src)
    table = torch.cat([before.transpose(1, 2).reshape(R * K, C), x])
    ext = torch.cat([table[rows], x[:, None]], dim=1).transpose(1, 2)  # [T, C, K + 1]
    if batch.verify_slots:
        rows_after, dst = _windows_kept(batch)
        window[torch.tensor(dst, device=x.device)] = ext[torch.tensor(rows_after, device=x.device), :, 1:].to(window.dtype)
    else:
        window[slots] = ext[qsl[1:] - 1, :, 1:].to(window.dtype)
    return ext


def _windows_kept(batch: ForwardBatch) -> tuple[list[int], list[int]]:
    """(token rows, slots): the window after each row goes to its slot: a request's last token to
    its live slot, or every token of a verifying request to that token's slot (host lists)."""
    qlens = batch.query_lens_cpu or (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    live = batch.state_slots.tolist()
    rows, dst, start = [], [], 0
    for r, q in enumerate(qlens):
        chain = batch.verify_slots.get(r)
        if chain is not None:
            rows.extend(range(start, start + q))
            dst.extend(chain[1:q + 1])
        elif q > 0:
            rows.append(start + q - 1)
            dst.append(live[r])
        start += q
    return rows, dst


def previous_token(x: torch.Tensor, pool: torch.Tensor, batch: ForwardBatch,
                   initial: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, C] -> [T, C], each token's predecessor in its request; pool [S, C] holds each
    request's last input (updated); `initial` [C] (None: zeros) precedes position 0."""
    return lagged_inputs(x, pool.unsqueeze(-1), batch, initial)[:, :, 0]
