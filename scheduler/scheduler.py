"""Continuous batching over the dual memory manager.

Each step: running decodes first, then running chunked prefills, then swapped-out requests, then
waiting ones (priority, then arrival), under a token budget and a cap on running sequences.
A prefill chunk is cut at the block boundary where the manager wants a state checkpoint, so the
state at that boundary exists at the end of the step. When blocks or slots run out the manager
evicts cached blocks and checkpoints first; if that is not enough, the lowest-priority,
latest-arriving running sequence is preempted (recompute or swap, per PreemptionPolicy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridkv.cache_manager import HybridCacheManager

from .preemption import PreemptionPolicy
from .request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request` from position `start`; `checkpoint` if a state
    checkpoint is due once they are computed."""

    request: Request
    start: int
    num_tokens: int
    slot_mapping: list[int]
    checkpoint: bool = False


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, manager: HybridCacheManager, policy: PreemptionPolicy,
                 max_num_batched_tokens: int, max_num_seqs: int):
        self.mgr = manager
        self.policy = policy
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.waiting: list[Request] = []   # new, and preempted by recompute
        self.swapped: list[Request] = []
        self.running: list[Request] = []

    # ---- queues ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request the manager already holds as running (a fork, or an imported snapshot)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def remove(self, req: Request) -> None:
        for q in (self.waiting, self.swapped, self.running):
            if req in q:
                q.remove(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_tokens
        # Decodes (one token left to compute) before prefills; within each, by priority/arrival.
        reqs = self.mgr.requests
        order = []
        for r in self.running:
            start = reqs[r.request_id].num_computed_tokens
            rem = r.num_tokens - start
            order.append((rem > 1, r.priority, r.arrival, start, rem, r))
        order.sort(key=lambda x: x[:3])
        for _, _, _, start, rem, req in order:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            chunk = self._fit_running(req, start, min(rem, budget), out)
            if chunk is not None:
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        for queue, resume in ((self.swapped, True), (self.waiting, False)):
            for req in sorted(queue, key=Request.sort_key):
                if budget == 0 or len(self.running) >= self.max_seqs:
                    return out
                chunk = self._start(req, budget, resume or self._is_preempted(req))
                if chunk is None:
                    return out  # keep FCFS: nobody overtakes the head of the queue
                queue.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
        return out

    def _remaining(self, req: Request) -> int:
        return req.num_tokens - self.mgr.request(req.request_id).num_computed_tokens

    def _is_preempted(self, req: Request) -> bool:
        return req.request_id in self.mgr.requests

    def _cut(self, req: Request, start: int, n: int) -> tuple[int, bool]:
        due = self.mgr.checkpoint_due(req.request_id, start, start + n)
        return (due - start, True) if due is not None else (n, False)

    def _fit_running(self, req: Request, start: int, n: int, out: SchedulerOutput) -> Optional[ScheduledChunk]:
        n, ckpt = self._cut(req, start, n)
        while True:
            slots = self.mgr.allocate(req.request_id, n)
            if slots is not None:
                return ScheduledChunk(req, start, n, slots, ckpt)
            victim = max((r for r in self.running if r.status is RequestStatus.RUNNING),
                         key=Request.sort_key)
            self._preempt(victim, out)
            if victim is req:
                return None

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        nc = self.mgr.request(victim.request_id).num_computed_tokens
        mode = self.policy.choose(nc)
        self.mgr.preempt(victim.request_id, mode)
        self.running.remove(victim)
        for c in list(out.chunks):
            if c.request is victim:
                out.chunks.remove(c)
        if mode == "swap":
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            victim.status = RequestStatus.WAITING
            self.waiting.append(victim)
        out.preempted.append((victim, mode))

    def _start(self, req: Request, budget: int, resume: bool) -> Optional[ScheduledChunk]:
        """Admit (or resume) a request with its first chunk, or None if memory is short now."""
        rid = req.request_id
        want = min(req.num_tokens, budget)
        if resume:
            start = self.mgr.resume(rid, num_new_tokens=min(want, budget))
        else:
            start = self.mgr.admit(rid, req.all_token_ids, max_tokens=req.params.max_tokens,
                                   cache_salt=req.cache_salt, num_new_tokens=want)
            if start is not None:
                req.num_cached_tokens = start
        if start is None:
            return None
        n, ckpt = self._cut(req, start, min(req.num_tokens - start, budget))
        slots = self.mgr.allocate(rid, n)
        assert slots is not None, "admit/resume promised room for this chunk"
        return ScheduledChunk(req, start, n, slots, ckpt)
