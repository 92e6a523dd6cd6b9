"""A request's life in the pools: fork, finish, preempt (recompute or swap) and resume.

A mixin of HybridCacheManager (kept apart so each file holds one concept); it uses the
manager's pools, tables, prefix cache and request states. Preempt by recompute releases blocks
(they stay findable by hash) and donates the live state at a block boundary as a checkpoint;
swap copies blocks and slot to host memory (transfer.py).
"""
from __future__ import annotations

from typing import Hashable, Optional

from hybridkv.errors import RequestStateError
from hybridkv.request_state import PREEMPTED, RUNNING, SWAPPED, RequestState
from hybridkv.state_pool import CHECKPOINT, LIVE


class LifecycleMixin:
    def fork(self, parent_id: Hashable, child_id: Hashable, token_ids: Optional[list[int]] = None) -> bool:
        """Start `child_id` as a copy of a running parent: full and partial blocks shared (copied on
        first write), slot copied. token_ids: the child's own token list (its owner appends to it),
        equal to the parent's now; None: the manager keeps a copy. False if no slot can be had now."""
        p = self._running(parent_id)
        if child_id in self._reqs:
            raise RequestStateError(f"request id {child_id!r} is already known to the manager")
        slot = 0
        if self.has_recurrent:
            slot = self.prefix.take_slot(LIVE)
            if slot is None:
                return False
            self.states.copy(p.slot, slot)
        shared = p.block_ids[: -(-p.num_computed_tokens // self.block_size)]
        self.blocks.ref(shared)
        if token_ids is not None and list(token_ids) != p.token_ids:
            raise RequestStateError(f"fork {child_id!r}: its token_ids differ from parent {parent_id!r}'s")
        c = RequestState(child_id, list(p.token_ids) if token_ids is None else token_ids, p.num_prompt_tokens, p.max_tokens, p.extra_key, p.cache_salt,
                         p.adapter_id, p.mm_hashes, RUNNING, p.num_computed_tokens, list(shared),
                         list(p.block_hashes), p.num_hashed_blocks, slot)
        if self.has_attention:
            c.row = self.tables.new_row()
            self.tables.write(c.row, 0, c.block_ids)
        self._reqs[child_id] = c
        return True

    def finish(self, req_id: Hashable) -> None:
        """Forget the request: release its blocks (full ones stay cached) and slot (kept as a
        checkpoint when the policy keeps final states and it ends at a block boundary)."""
        r = self.request(req_id)
        if r.status is RUNNING:
            self._release_slot(r, donate=self.policy.keeps_final_state)
            self._release_blocks(r)
        if r.rolling_checkpoint in self.prefix.checkpoints:
            # only a continuation of this exact answer (the next turn of a chat) reuses it:
            # first to go when slots are short, unless it is hit before
            self.prefix.checkpoints.move_to_end(r.rolling_checkpoint, last=False)
        r.swapped = None
        del self._reqs[req_id]

    def preempt(self, req_id: Hashable, mode: str = "recompute") -> None:
        """recompute: drop blocks and slot (its state at the last block boundary is donated as a
        checkpoint); resume() re-matches the prefix. swap: copy blocks and slot to host, free them."""
        r = self._running(req_id)
        if mode == "recompute":
            self._release_slot(r, donate=True)
            self._release_blocks(r)
            r.num_computed_tokens = r.num_hashed_blocks = 0
            r.status = PREEMPTED
        elif mode == "swap":
            self._swap_out(r)
            r.status = SWAPPED
        else:
            raise ValueError(f"preemption mode {mode!r}; choose 'recompute' or 'swap'")
        self._preemptions[mode] += 1

    def resume(self, req_id: Hashable, num_new_tokens: Optional[int] = None) -> Optional[int]:
        """Restart a preempted request; returns its num_computed_tokens, or None if it cannot run now."""
        r = self.request(req_id)
        if r.status is PREEMPTED:
            return self._start(r, num_new_tokens)
        if r.status is SWAPPED:
            return self._swap_in(r, num_new_tokens)
        raise RequestStateError(f"request {req_id!r} is {r.status}, not preempted")

    def _running(self, req_id: Hashable) -> RequestState:
        r = self.request(req_id)
        if r.status is not RUNNING:
            raise RequestStateError(f"request {req_id!r} is {r.status}, not running")
        return r

    def _release_slot(self, r: RequestState, donate: bool) -> None:
        if not r.slot:
            return
        nc = r.num_computed_tokens
        if donate and self.enable_prefix_caching and nc and nc % self.block_size == 0:
            h = self._boundary_hash(r)
            if h not in self.prefix.checkpoints:  # the live state becomes the checkpoint, no copy
                self.states.mark(r.slot, CHECKPOINT)
                self.prefix.add(h, nc, r.slot)
                r.slot = 0
                return
        self.states.free(r.slot)
        r.slot = 0

    def _release_blocks(self, r: RequestState) -> None:
        self.blocks.release(r.block_ids)
        r.block_ids = []
        if r.row >= 0:
            self.tables.free_row(r.row)
            r.row = -1

    def _slot_available(self) -> bool:
        return not self.has_recurrent or self.states.num_free > 0 or bool(self.prefix.checkpoints)
