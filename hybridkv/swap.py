"""Swap preemption over the kinds of layer memory: a preempted request's memory copied to host
memory (`swap_out`) and back into fresh blocks and a fresh slot (`swap_in`), byte for byte.

With a host tier (memory/host_tier.py) the copy is held by the tier's budget from swap-out until
swap-in or the request's end (`drop`), entries evicted for it; a copy the budget cannot hold is
refused and the manager preempts by recompute instead. Without one, swap is bounded by nothing
but host memory."""
from __future__ import annotations

from typing import Optional, Sequence

from hybridkv.request import Request, RequestStatus


def swap_out(r: Request, kinds: Sequence, host) -> bool:
    """Copy running request r's memory in every kind to the host and let go of it there (r becomes
    SWAPPED); False, changing nothing, when the host tier `host` (or None) cannot hold the copy."""
    rid, nc = r.request_id, r.num_computed_tokens
    if host is not None and not host.hold(rid, sum(k.swap_bytes(rid, nc) for k in kinds)):
        return False
    r.swapped = {kind.name: kind.swap_out(rid, nc) for kind in kinds}
    r.status = RequestStatus.SWAPPED
    return True


def swap_in(r: Request, kinds: Sequence, hashes: Sequence[bytes], num_new_tokens: Optional[int], host) -> Optional[int]:
    """Place swapped r's copy back (r becomes RUNNING at its num_computed_tokens, returned), its
    full blocks findable under `hashes`; None when a kind cannot take it with its next
    `num_new_tokens` (None: all its tokens) now."""
    nc = r.num_computed_tokens
    end = len(r.token_ids) if num_new_tokens is None else nc + num_new_tokens
    if not all(k.can_swap_in(r.swapped[k.name], end) for k in kinds):
        return None
    for kind in kinds:
        kind.swap_in(r.request_id, r.swapped[kind.name], hashes, nc)
    drop(r, host)
    r.status, r.resumed_from = RequestStatus.RUNNING, nc
    return nc


def drop(r: Request, host) -> None:
    """r's host copy is gone (swapped back in, or r ended): the host budget no longer holds it."""
    if r.swapped is not None and host is not None:
        host.let_go(r.request_id)
    r.swapped = None
