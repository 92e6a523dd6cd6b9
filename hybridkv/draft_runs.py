"""Speculative decoding's memory: a running request verifies a draft of k tokens in one step
(docs/design.md, "Speculative decoding", and the draft rows of "The semantics, verb by verb").

`allocate` gives the run its k + 1 positions: KV write slots from num_computed_tokens and a chain
of state slots (the live slot, then a draft slot per position: memory/recurrent.py), never by
preempting or evicting. `commit` keeps the accepted positions: they are committed, a state
checkpoint due inside the run is copied from its position's draft slot, the state after the last
kept token becomes the live one (a slot move), and the KV and draft slots of rejected positions
go back. A run that is never committed is freed by the manager's `finish` / `preempt`.
A draft model's own manager (speculative/draft_model.py) runs its proposals as such a run of
k = 0 or more speculative tokens after its last real one and keeps none of it (`commit(rid, 0)`).

Owned by the HybridCacheManager (`mgr.drafts`); it runs over the manager's kinds and leaves the
request's progress to the manager's `commit`.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

from hybridkv.errors import RequestStateError

# The manager that owns this (a HybridCacheManager); not imported, so the arrow between the two
# modules points one way: cache_manager -> draft_runs.
Manager = Any


class DraftRuns:
    """The draft-run verbs of one manager (`mgr.drafts`)."""

    def __init__(self, mgr: Manager):
        self.mgr = mgr

    def allocate(self, req_id: Hashable, num_draft: int) -> Optional[tuple[list[int], list[int]]]:
        """For a running request with exactly one token left to compute, to verify a draft of
        num_draft >= 0 tokens: (KV write slots of its num_draft + 1 positions from num_computed_tokens,
        -1 each without attention; its state slot chain [live slot, then a draft slot per
        position], [] without recurrent layers). None when a pool cannot give them without
        evicting (speculation never preempts, never evicts a checkpoint); then nothing changed."""
        mgr = self.mgr
        r = mgr.running(req_id)
        n = num_draft + 1
        if len(r.token_ids) - r.num_computed_tokens != 1 or num_draft < 0:
            raise RequestStateError(f"draft of {num_draft} tokens for {req_id!r}: it must have exactly one "
                                    f"token left to compute and a draft of zero or more")
        start = r.num_computed_tokens
        rec = mgr.recurrent
        if rec is not None and not rec.can_take_draft_slots(n):
            return None
        if not all(kind.can_allocate(req_id, start, start + n) for kind in mgr.allocating_kinds):
            return None
        for kind in mgr.allocating_kinds:
            kind.allocate(req_id, start, start + n)
        chain = [rec.live_slot(req_id), *rec.take_draft_slots(req_id, n)] if rec is not None else []
        kv = mgr.attention.slot_mapping(req_id, start, start + n) if mgr.attention is not None else [-1] * n
        return kv, chain

    def commit(self, req_id: Hashable, num_tokens: int) -> None:
        """The verified run keeps its first num_tokens positions (the token before the draft, then
        the accepted draft tokens; its token list holds them now); 0: none (the live state and
        num_computed_tokens stay as they were). On a raise,
        `finish(req_id, discard=True)` frees what is left."""
        mgr = self.mgr
        r = mgr.running(req_id)
        start = r.num_computed_tokens
        end = start + num_tokens
        mgr.commit(req_id, num_tokens)
        rec = mgr.recurrent
        if rec is not None:
            slots, b = rec.draft_slots(req_id), start
            while (b := mgr.prefix_cache.checkpoint_due(req_id, b, end)) is not None:  # the run's boundaries
                mgr.prefix_cache.store(r, b, slots[b - start - 1])
            rec.accept_draft(req_id, num_tokens)
        for kind in mgr.kinds:
            kind.trim(req_id, end)
