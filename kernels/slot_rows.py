"""Where a one-token decode step updates a state pool: in place, when the batch's slots allow it.

A fresh batch gets slots 1..B (the state pool hands out low ids first) and a steady one often
keeps a permutation of one range; the batch's rows are then the view pool[lo:lo + B], in slot
order, and a decode kernel updates them where they live instead of gathering a copy and writing
it back. Anything else (holes, a repeated slot, a non-contiguous pool) gets None: gather instead.
"""
from __future__ import annotations

import torch


def slot_range(pool: torch.Tensor, slots: torch.Tensor):
    """pool [S, ...]; slots [B] long -> (rows, order).

    rows: the view pool[lo:lo + B] when the slots are a permutation of lo .. lo + B - 1 and the
    pool is contiguous, else None. order [B] long: the requests in slot order (rows[i] belongs to
    request order[i]), or None when the slots are already ascending.
    """
    nb = slots.shape[0]
    if nb == 0 or not pool.is_contiguous():
        return None, None
    lo = int(slots.min())
    if int(slots.max()) - lo != nb - 1:
        return None, None
    if bool((slots[1:] > slots[:-1]).all()):
        return pool[lo:lo + nb], None
    ranked, order = slots.sort()
    if not bool((ranked[1:] > ranked[:-1]).all()):  # a slot twice: keep the gather's semantics
        return None, None
    return pool[lo:lo + nb], order
