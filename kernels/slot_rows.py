"""Where a one-token decode step updates a state pool: in place, over runs of consecutive slots.

A fresh batch gets slots 1..B (the state pool hands out low ids first), but once checkpoints and
finished requests have taken slots, a batch's slots are a few runs of consecutive ids
(e.g. 1..19, 38..49, 62). Each run is the view pool[lo:lo + n]; a decode kernel updates those
rows where they live instead of gathering a copy of every state and writing it back (two extra
passes over megabytes of state per layer). Too many runs (mostly single slots), a repeated slot,
a non-contiguous or half-precision pool: gather once, update the copy, write it back once.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def slot_runs(pool: torch.Tensor, slots: torch.Tensor, max_runs: int | None = None):
    """pool [S, ...]; slots [B] long -> (runs, order), or (None, None) when the batch should gather.

    runs: [(lo, a, b)]: the view pool[lo:lo + b - a] holds, row for row, the states of the
    requests order[a:b] (slot order). order [B] long, or None when the slots are ascending.
    max_runs (default B // 2, at least 1): more runs than this gather instead.
    """
    nb = slots.shape[0]
    if nb == 0 or not pool.is_contiguous():
        return None, None
    ids = slots.tolist()
    ascending = all(a < b for a, b in zip(ids, ids[1:]))
    order = None
    if not ascending:
        order = sorted(range(nb), key=ids.__getitem__)
        ids = [ids[i] for i in order]
        if any(a == b for a, b in zip(ids, ids[1:])):  # a slot twice: keep the gather's semantics
            return None, None
    runs, a = [], 0
    for i in range(1, nb + 1):
        if i == nb or ids[i] != ids[i - 1] + 1:
            runs.append((ids[a], a, i))
            a = i
    if len(runs) > (max_runs if max_runs is not None else max(1, nb // 2)):
        return None, None
    return runs, (None if order is None else torch.tensor(order, device=slots.device))


def update_slot_rows(pool: torch.Tensor, slots: torch.Tensor, per_request: Sequence[torch.Tensor],
                     update: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Run `update(rows, *inputs)` over the batch's state rows of `pool`, in place.

    pool [S, ...]; slots [B] long; per_request: tensors [B, ...] in request order.
    update(rows [n, ...] fp32, updated in place, *inputs cut to the same n requests) -> out [n, ...].
    Returns the outputs [B, ...] in request order; the pool holds the updated states.
    """
    runs, order = slot_runs(pool, slots) if pool.dtype == torch.float32 else (None, None)
    if runs is None:
        rows = pool.index_select(0, slots)
        rows = rows if rows.dtype == torch.float32 else rows.float()
        out = update(rows, *per_request)
        pool.index_copy_(0, slots, rows.to(pool.dtype))
        return out
    if order is not None:  # requests permuted into slot order, the outputs permuted back below
        per_request = [t.index_select(0, order) for t in per_request]
    outs = [update(pool[lo:lo + b - a], *(t[a:b] for t in per_request)) for lo, a, b in runs]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if order is None else torch.empty_like(out).index_copy_(0, order, out)
