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


def scan_requests(pool: torch.Tensor, spans, return_states_at, piece) -> list[torch.Tensor]:
    """Run each request's tokens through `piece` from its slot's state, in place in `pool`.

    pool [S, ...]: a recurrent pool; spans from `request_spans`. `piece(h, a, b) -> h` advances the
    fp32 state `h` over packed tokens [a, b) (writing its outputs itself). A request without an
    initial state starts from zeros. The scan is cut at the requested positions, so the state there
    equals running only that prefix; the final state is written back to the slot. Returns, per
    request, the states at its requested positions as `[n_pos, ...]` in pool.dtype.
    """
    states = []
    for r, (start, end, slot, init) in enumerate(spans):
        h = pool[slot].float() if init else pool.new_zeros(pool.shape[1:], dtype=torch.float32)
        wanted = [] if return_states_at is None else [int(p) for p in return_states_at[r]]
        at, prev = {}, 0
        for cut in state_cuts(end - start, wanted, r):
            h = piece(h, start + prev, start + cut)
            at[cut] = h.to(pool.dtype)
            prev = cut
        if end > start or not init:
            pool[slot] = h.to(pool.dtype)
        states.append(torch.stack([at[p] for p in wanted]) if wanted
                      else pool.new_zeros(0, *pool.shape[1:]))
    return states
