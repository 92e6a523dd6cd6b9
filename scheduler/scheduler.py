"""Continuous batching over the dual memory manager (docs/design.md, "Scheduling").

Each step: the running decodes as one DecodeBatch (step_plan.py: it allocates and commits its
rows in one manager call each), then running chunked prefills, then swapped-out requests, then
waiting ones (priority, then arrival), under a token budget and a cap on running requests.
FCFS: nobody overtakes the head of the swapped or waiting queue, except a new request the
prefix cache holds back for a running one computing the prefix they share (burst rule) or while
the disk files of its hit are read off the step (read-ahead rule; an idle step waits for one). Prefill
chunks are cut where a state checkpoint is due. When a pool is short after eviction, the
lowest-priority, latest-arriving running request is preempted (recompute or swap, per
PreemptionPolicy). A verb that raises for one request ends it alone with "error" (`fail`); the
scan goes on. This file plans a step and owns the queues; what the model runner computed is
applied to the requests after the forward pass by step_results.py (`StepResults`). The two are
the only callers that change the memory manager.
"""
from __future__ import annotations

import logging
from typing import Hashable, Optional

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request, RequestStatus, run_order

from .hit_guard import HitGuard
from .preemption import PreemptionPolicy
from .request_group import RequestGroup
from .sequence_queue import SequenceQueue
from .speculation import Speculation
from .step_plan import DecodeBatch, ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)
IDLE_READ_WAIT_S = 0.05  # a step with nothing to run waits this long at most for a disk read ahead


class Scheduler:
    def __init__(self, manager: HybridCacheManager, policy: PreemptionPolicy,
                 max_num_batched_tokens: int, max_num_seqs: int):
        self.mgr = manager
        self.policy = policy
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.waiting = SequenceQueue()   # new, and preempted by recompute
        self.swapped = SequenceQueue()
        self.running = SequenceQueue()
        # False: the decode batch is made afresh each step, never carried over (for twin tests)
        self.carry_decode_batch = True
        self.last_batch: Optional[DecodeBatch] = None  # run and committed whole (step_results.py): may carry over
        self.batches_cut = 0  # batches made by cutting the last one to the sequences left (internal)
        self.groups: dict[Hashable, RequestGroup] = {}  # the requests, by key (engine.py)
        self.counters = {"generated_tokens": 0, "forks": 0, "failed": 0,
                         "decode_batch_steps": 0, "carried_decode_batches": 0}
        self.speculation: Optional[Speculation] = None  # drafts for the decodes (speculation.py), or off
        self.hit_guard: Optional[HitGuard] = None  # verify_cache_hits > 0 (hit_guard.py), or off

    # ---- queues ----------------------------------------------------------------------------
    def add(self, seq: Request) -> None:
        """Queue a sequence the manager does not hold (new, or a fork that found no slot). The
        manager's verbs set a request's status (admit, resume, preempt, fork, import), the
        scheduler only FINISHED."""
        self.waiting.add(seq)

    def add_running(self, seq: Request) -> None:
        """A sequence the manager already holds as running (a fork, or an imported snapshot:
        migration.py's export_request / import_request are the scheduler's migration verbs)."""
        self.running.add(seq)

    def finish(self, seq: Request, reason: str) -> None:
        """End `seq` now (stopped, aborted, migrated away): out of its queue, memory freed."""
        if seq.finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if queue.remove(seq):
                break
        if seq.request_id in self.mgr.requests:
            self.mgr.finish(seq.request_id)
        seq.status, seq.finish_reason = RequestStatus.FINISHED, reason
        if self.speculation is not None:
            self.speculation.forget(seq.request_id)
        if self.hit_guard is not None:
            self.hit_guard.forget(seq.request_id)
        self.mgr.prefix_cache.forget_disk_read(seq.request_id)

    def fail(self, seq: Request, error: BaseException | str, discard: bool = False) -> None:
        """End `seq` with finish_reason "error" and free its memory. discard: its live memory ran
        past num_computed_tokens (a forward or commit failed), so none of it may be cached."""
        if seq.finished:
            return
        rid = seq.request_id
        log.warning("request %r failed: %s", rid, error)
        try:
            if discard and rid in self.mgr.requests:
                self.mgr.finish(rid, discard=True)  # frees without keeping the (advanced) state or new blocks
            self.finish(seq, "error")
        except Exception as e:  # the manager could not free it: say so, never raise from here
            log.error("request %r: freeing its memory failed too: %r", rid, e)
            for queue in (self.running, self.waiting, self.swapped):
                queue.remove(seq)
            seq.status, seq.finish_reason = RequestStatus.FINISHED, "error"
        seq.error = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = self._plan()
        if self.hit_guard is not None:  # the runner keeps the logits the guard compares
            for c in out.chunks:
                c.keep_logits = self.hit_guard.wants_logits(c.seq.request_id)
        return out

    def _plan(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.max_tokens
        last, self.last_batch = self.last_batch, None  # a kept batch serves the very next step only
        batch, rest = None, []
        if self.running and budget > 0:
            batch, rest = DecodeBatch.of_running(self.running, last if self.carry_decode_batch else None,
                                                 self.mgr, budget)
        if batch is not None:
            self.counters["carried_decode_batches"] += batch.carried
            self.batches_cut += batch.cut
            out.decodes = batch.allocate(lambda: self._preempt(max(self.running, key=run_order), out))
            budget -= len(out.decodes) if out.decodes is not None else 0
            if self.speculation is not None:  # rows with a draft verify it as chunks
                budget = self.speculation.take_drafts(self.mgr, out, budget)
        for start, seq in rest:  # the last prompt token of some, then prefills; in run order
            if budget == 0:
                break
            if seq.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            chunk = self._fit_running(seq, start, min(seq.num_tokens - start, budget), out)
            if chunk is not None:
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        room = self.max_seqs - len(self.running)
        if room > 1 and len(self.waiting) > 1:  # burst rule: leaders learn where to checkpoint first
            try:
                self.mgr.prefix_cache.plan_bursts([(s.request_id, s.token_ids, s.cache_salt)
                                                   for s in self.waiting.head(room)])
            except Exception as e:  # an optimisation: a step without it is still correct
                log.error("burst planning failed, skipped this step: %r", e)
        for queue in (self.swapped, self.waiting):
            budget = self._admit_from(queue, budget, out)
            if budget < 0:
                break
        if out.held and out.decodes is None and not out.chunks:  # only held requests: wait for a read, not spin
            self.mgr.prefix_cache.wait_for_disk_reads(IDLE_READ_WAIT_S)
        return out

    def _admit_from(self, queue: SequenceQueue, budget: int, out: SchedulerOutput) -> int:
        """Start sequences from the head of `queue` while they fit; the budget left, or -1 when
        the scan must stop here (budget or seat cap reached, or the head does not fit now)."""
        held: list[Request] = []  # waiting a step for a shared prefix or disk reads: back in place afterwards
        try:
            while (seq := queue.peek()) is not None:
                if budget == 0 or len(self.running) >= self.max_seqs:
                    return -1
                known = seq.request_id in self.mgr.requests  # swapped, or preempted by recompute
                try:
                    if self._holds(seq, known):
                        held.append(queue.pop())
                        out.held += 1
                        if len(held) >= self.max_seqs:
                            return -1  # bound the scan: a burst must not make a step cost the queue
                        continue
                    chunk = self._start(seq, budget, known)
                except Exception as e:
                    self.fail(seq, e)
                    out.failed.append(seq)
                    continue
                if chunk is None:
                    return -1  # keep FCFS: nobody overtakes the head of the queue
                queue.remove(seq)
                self.running.add(seq)
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
            return budget
        finally:
            for seq in held:
                queue.add(seq)

    def _holds(self, seq: Request, known: bool) -> bool:
        """Hold seq a step (skipped, not refused): by the burst rule, or while its disk reads run."""
        pc = self.mgr.prefix_cache
        return not known and pc.waits_for_shared_prefix(seq.request_id, seq.token_ids, cache_salt=seq.cache_salt) \
            or seq.status is RequestStatus.WAITING and pc.waits_for_disk_read(seq)

    def _cut(self, seq: Request, start: int, n: int) -> tuple[int, bool]:
        due = self.mgr.prefix_cache.checkpoint_due(seq.request_id, start, start + n)  # a chunk ends at a checkpoint
        return (due - start, True) if due is not None else (n, False)

    def _fit_running(self, seq: Request, start: int, n: int, out: SchedulerOutput) -> Optional[ScheduledChunk]:
        try:
            n, ckpt = self._cut(seq, start, n)
            while True:
                slots = self.mgr.allocate(seq.request_id, n)
                if slots is not None:
                    return ScheduledChunk(seq, start, n, slots, ckpt)
                victim = max(self.running, key=run_order)
                self._preempt(victim, out)
                if victim is seq or seq.finished:
                    return None
        except Exception as e:
            self.fail(seq, e)
            out.failed.append(seq)
            return None

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        out.drop(victim)
        try:
            mode = self.policy.choose(victim.num_computed_tokens)
            mode = self.mgr.preempt(victim.request_id, mode)  # swap may turn recompute (host budget)
        except Exception as e:  # the victim alone fails; its memory is freed all the same
            self.fail(victim, e)
            out.failed.append(victim)
            return
        self.running.remove(victim)
        (self.swapped if mode == "swap" else self.waiting).add(victim)  # the manager set its status
        out.preempted.append((victim, mode))

    def _start(self, seq: Request, budget: int, resume: bool) -> Optional[ScheduledChunk]:
        """Admit (or resume) a sequence with its first chunk, or None if memory is short now."""
        rid = seq.request_id
        want = min(seq.num_tokens, budget)
        if resume:
            start = self.mgr.resume(rid, num_new_tokens=want)
        else:
            start = self.mgr.admit(seq, num_new_tokens=want)
            if start is not None:
                seq.num_cached_tokens = start
                if start and self.hit_guard is not None and seq.num_tokens == seq.num_prompt_tokens:
                    self._shadow(self.hit_guard.on_hit(seq, start, self.mgr.block_size))
        if start is None:
            return None
        n, ckpt = self._cut(seq, start, min(seq.num_tokens - start, budget))
        slots = self.mgr.allocate(rid, n)
        assert slots is not None, "admit/resume promised room for this chunk"
        return ScheduledChunk(seq, start, n, slots, ckpt)

    def _shadow(self, shadow: Optional[Request]) -> None:
        """Queue the hit guard's cold recompute of a hit (a group of its own that reports nothing)."""
        if shadow is not None:
            g = RequestGroup(str(shadow.request_id), None, shadow.params, [shadow], key=shadow.request_id)
            g.background = True
            self.groups[g.key] = g
            self.waiting.add(shadow)
