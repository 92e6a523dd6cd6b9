"""Helpers shared by the varlen torch references: request bounds and state-return positions."""
from __future__ import annotations

import torch


def request_spans(query_start_loc: torch.Tensor, num_slots: int, slot_idx: torch.Tensor,
                  has_initial_state: torch.Tensor | None = None) -> list[tuple[int, int, int, bool]]:
    """(start, end, slot, has_initial_state) per request from `query_start_loc [R+1]`, `slot_idx [R]`.

    Checks that the three agree in length and that every slot lies inside the pool.
    """
    qsl = [int(v) for v in query_start_loc.tolist()]
    slots = [int(v) for v in slot_idx.tolist()]
    if len(qsl) != len(slots) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries but slot_idx has {len(slots)} "
                         "requests; query_start_loc must have one entry more than slot_idx")
    init = [True] * len(slots) if has_initial_state is None else [
        bool(v) for v in has_initial_state.tolist()]
    if len(init) != len(slots):
        raise ValueError(f"has_initial_state has {len(init)} entries, slot_idx has {len(slots)}")
    for s in slots:
        if not 0 <= s < num_slots:
            raise ValueError(f"slot index {s} is outside the state pool of {num_slots} slots")
    spans = []
    for r, slot in enumerate(slots):
        if qsl[r + 1] < qsl[r]:
            raise ValueError(f"query_start_loc must be non-decreasing; request {r} spans "
                             f"[{qsl[r]}, {qsl[r + 1]})")
        spans.append((qsl[r], qsl[r + 1], slot, init[r]))
    return spans


def state_cuts(length: int, positions: list[int] | None, request: int) -> list[int]:
    """Sorted unique cut points in (0, length] covering `positions` and `length` itself.

    A scan run piece by piece between these cuts hands back the state at each requested position,
    and equals running only that prefix in a separate call.
    """
    cuts = set()
    for p in positions or []:
        p = int(p)
        if not 1 <= p <= length:
            raise ValueError(f"return_states_at position {p} of request {request} is outside "
                             f"1..{length} (the request's token count in this call)")
        cuts.add(p)
    if length > 0:
        cuts.add(length)
    return sorted(cuts)


def check_positions_arg(return_states_at, num_requests: int) -> None:
    """return_states_at must be None or one list of positions per request."""
    if return_states_at is not None and len(return_states_at) != num_requests:
        raise ValueError(f"return_states_at has {len(return_states_at)} lists for "
                         f"{num_requests} requests; give one (possibly empty) list per request")
