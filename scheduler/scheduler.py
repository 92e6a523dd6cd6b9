"""Continuous batching over the dual memory manager.

Each step: running decodes first, then running chunked prefills, then swapped-out sequences, then
waiting ones (priority, then arrival), under a token budget and a cap on running sequences.
FCFS: when the head of the swapped or waiting queue does not fit, nobody behind it starts. The one
exception is a new sequence the manager holds back for a running one that is computing the prefix
they share (burst rule): it stays waiting and the scan goes on, as it is not short of memory.
A prefill chunk is cut at the block boundary where the manager wants a state checkpoint, so the
state at that boundary exists at the end of the step. When blocks or slots run out the manager
evicts cached blocks and checkpoints first; if that is not enough, the lowest-priority,
latest-arriving running sequence is preempted (recompute or swap, per PreemptionPolicy) and goes
back to its queue. Queues are keyed by id (sequence_queue.py): a step costs what it schedules.
When every running sequence is a plain decode, they go out as one DecodeBatch (step_plan.py),
kept and advanced a token a step while the running queue's version stays the same.
A verb that raises for one sequence (admit, swap-in, swap-out, allocate) ends that sequence
alone with "error" (`fail`, listed in `SchedulerOutput.failed`); the scan goes on for the rest.
"""
from __future__ import annotations

import itertools
import logging
from operator import attrgetter
from typing import Optional

import numpy as np

from hybridkv.cache_manager import HybridCacheManager

from .preemption import PreemptionPolicy
from .sequence import Sequence, SequenceStatus, run_order
from .sequence_queue import SequenceQueue
from .step_plan import DecodeBatch, ScheduledChunk, SchedulerOutput

_request_id = attrgetter("request_id")
_num_computed = attrgetter("num_computed_tokens")
_num_prompt = attrgetter("num_prompt_tokens")
_token_ids = attrgetter("token_ids")

log = logging.getLogger(__name__)


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
        # Steps in which every running sequence is a plain decode come as one DecodeBatch
        # (step_plan.py); False: every step as ScheduledChunks (the general path, for tests).
        self.batch_decodes = True
        self._advanced: Optional[DecodeBatch] = None  # the last batch the engine ran whole
        self.batches_cut = 0  # batches made by cutting the last one to the sequences left (internal)

    # ---- queues ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence the manager does not hold (new, or a fork that found no slot)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence the manager already holds as running (a fork, or an imported snapshot)."""
        seq.status = SequenceStatus.RUNNING
        self.running.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now (stopped, aborted, migrated away): out of its queue, memory freed."""
        if seq.finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if queue.remove(seq):
                break
        if seq.request_id in self.mgr.requests:
            self.mgr.finish(seq.request_id)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def fail(self, seq: Sequence, error: BaseException | str, discard: bool = False) -> None:
        """End `seq` with finish_reason "error" and free its memory. discard: its live memory ran
        past num_computed_tokens (a forward or commit failed), so none of it may be cached."""
        if seq.finished:
            return
        rid = seq.request_id
        log.warning("request %r failed: %s", rid, error)
        try:
            if discard and rid in self.mgr.requests:
                self.mgr.discard(rid)  # frees without keeping the (advanced) state or new blocks
            self.finish(seq, "error")
        except Exception as e:  # the manager could not free it: say so, never raise from here
            log.error("request %r: freeing its memory failed too: %r", rid, e)
            for queue in (self.running, self.waiting, self.swapped):
                queue.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
        seq.error = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_tokens
        last, self._advanced = self._advanced, None  # a kept batch serves the very next step only
        batch = self._steady_decodes(budget, last) if self.batch_decodes else None
        if batch is not None:  # every running sequence is a plain decode: one array-based batch
            slots, due, done = self.mgr.allocate_decodes(batch.rows, batch.positions)
            if done.all():
                batch.kv_slots, batch.checkpoints = slots, np.flatnonzero(due).tolist()
                out.decodes, decodes, prefills = batch, [], []
                budget -= len(batch)
            else:  # a pool is short: those go one by one below, preempting as needed
                decodes, prefills = list(zip(batch.positions.tolist(), batch.seqs)), []
                decodes, budget = self._place_decodes(decodes, slots.tolist(), due.tolist(), done.tolist(),
                                                      budget, out)
        else:
            # Decodes (one token left to compute) before prefills; within each, by priority/arrival.
            reqs = self.mgr.requests
            decodes, prefills = [], []
            for seq in self.running:  # run order, kept within decodes and within prefills
                start = reqs[seq.request_id].num_computed_tokens
                (decodes if len(seq.token_ids) - start <= 1 else prefills).append((start, seq))
            if decodes and len(decodes) <= budget:
                decodes, budget = self._plain_decodes(decodes, budget, out)
        for start, seq in itertools.chain(decodes, prefills):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            chunk = self._fit_running(seq, start, min(seq.num_tokens - start, budget), out)
            if chunk is not None:
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        room = self.max_seqs - len(self.running)
        if room > 1 and len(self.waiting) > 1:  # burst rule: leaders learn where to checkpoint first
            try:
                self.mgr.plan_bursts([(s.request_id, s.token_ids, s.cache_salt) for s in self.waiting.head(room)
                                      if s.request_id not in self.mgr.requests])
            except Exception as e:  # an optimisation: a step without it is still correct
                log.error("burst planning failed, skipped this step: %r", e)
        for queue in (self.swapped, self.waiting):
            budget = self._admit_from(queue, budget, out)
            if budget < 0:
                break
        return out

    def _steady_decodes(self, budget: int, last: Optional[DecodeBatch]) -> Optional[DecodeBatch]:
        """The running sequences as one DecodeBatch (positions only) when every one of them is a
        plain decode (one token left, past its prompt) and the budget takes them all, else None.
        After `last`, a batch the engine ran whole in the step before (`decoded`), and while
        nobody joined or left since, it is that batch one token later: no look at each sequence;
        when some left and nobody joined, it is that batch cut to those left (`DecodeBatch.kept`)."""
        running = self.running
        n = len(running)
        if not n or n > budget:
            return None
        if last is not None and last.version == running.version:
            return last.advanced(running.version)
        if last is not None and last.added == running.added:  # some left, nobody joined: cut the batch
            running_ = SequenceStatus.RUNNING
            keep = [i for i, seq in enumerate(last.seqs) if seq.status is running_]
            if len(keep) == n:
                self.batches_cut += 1
                return last.kept(keep, running.version)
        seqs = list(running)  # run order
        states = list(map(self.mgr.requests.__getitem__, map(_request_id, seqs)))
        positions = np.fromiter(map(_num_computed, states), np.int64, n)
        known = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, n)
        prompt = np.fromiter(map(_num_prompt, seqs), np.int64, n)
        if not ((known - positions == 1) & (positions >= prompt)).all():
            return None
        return DecodeBatch(seqs, self.mgr.decode_rows([s.request_id for s in seqs]), positions, running.version,
                           added=running.added)

    def decoded(self, batch: DecodeBatch) -> None:
        """The engine computed, committed and appended one token for every sequence of `batch`
        (those that failed or stopped left the running queue): the next step may advance it."""
        self._advanced = batch

    def _plain_decodes(self, decodes: list[tuple[int, Sequence]], budget: int, out: SchedulerOutput
                       ) -> tuple[list[tuple[int, Sequence]], int]:
        """Schedule the decodes in one manager call (`allocate_decodes`); returns those it could
        not allocate without preempting, still in run order, and the budget left. A later
        preemption takes a victim's chunk out again, as for any chunk."""
        slots, due, done = self.mgr.allocate_decodes([seq.request_id for _, seq in decodes],
                                                     [start for start, _ in decodes])
        return self._place_decodes(decodes, slots.tolist(), due.tolist(), done.tolist(), budget, out)

    def _place_decodes(self, decodes: list[tuple[int, Sequence]], slots, due, done, budget: int,
                       out: SchedulerOutput) -> tuple[list[tuple[int, Sequence]], int]:
        """Chunks for the decodes `allocate_decodes` answered (slots, due, done per decode);
        returns the others, in run order, and the budget left."""
        rest, chunks = [], out.chunks
        if all(done):  # the usual step: one comprehension, no per-decode branch
            chunks.extend([ScheduledChunk(seq, start, 1, [slot], ckpt, start >= seq.num_prompt_tokens)
                           for (start, seq), slot, ckpt in zip(decodes, slots, due)])
            return rest, budget - len(decodes)
        for (start, seq), slot, ckpt, ok in zip(decodes, slots, due, done):
            if ok:  # past the prompt: a plain decode (the last prompt token samples the first output)
                chunks.append(ScheduledChunk(seq, start, 1, [slot], ckpt, start >= seq.num_prompt_tokens))
            else:
                rest.append((start, seq))
        return rest, budget - (len(decodes) - len(rest))

    def _admit_from(self, queue: SequenceQueue, budget: int, out: SchedulerOutput) -> int:
        """Start sequences from the head of `queue` while they fit; the budget left, or -1 when
        the scan must stop here (budget or seat cap reached, or the head does not fit now)."""
        held: list[Sequence] = []  # waiting one step for a shared prefix: back in place afterwards
        try:
            while (seq := queue.peek()) is not None:
                if budget == 0 or len(self.running) >= self.max_seqs:
                    return -1
                known = seq.request_id in self.mgr.requests  # swapped, or preempted by recompute
                try:
                    if not known and self.mgr.waits_for_shared_prefix(seq.request_id, seq.token_ids,
                                                                      cache_salt=seq.cache_salt):
                        held.append(queue.pop())
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
                seq.status = SequenceStatus.RUNNING
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
            return budget
        finally:
            for seq in held:
                queue.add(seq)

    def _cut(self, seq: Sequence, start: int, n: int) -> tuple[int, bool]:
        due = self.mgr.checkpoint_due(seq.request_id, start, start + n)
        return (due - start, True) if due is not None else (n, False)

    def _fit_running(self, seq: Sequence, start: int, n: int, out: SchedulerOutput) -> Optional[ScheduledChunk]:
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

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        out.chunks = [c for c in out.chunks if c.seq is not victim]
        try:
            nc = self.mgr.request(victim.request_id).num_computed_tokens
            mode = self.policy.choose(nc)
            self.mgr.preempt(victim.request_id, mode)
        except Exception as e:  # the victim alone fails; its memory is freed all the same
            self.fail(victim, e)
            out.failed.append(victim)
            return
        self.running.remove(victim)
        if mode == "swap":
            victim.status = SequenceStatus.SWAPPED
            self.swapped.add(victim)
        else:
            victim.status = SequenceStatus.WAITING
            self.waiting.add(victim)
        out.preempted.append((victim, mode))

    def _start(self, seq: Sequence, budget: int, resume: bool) -> Optional[ScheduledChunk]:
        """Admit (or resume) a sequence with its first chunk, or None if memory is short now."""
        rid = seq.request_id
        want = min(seq.num_tokens, budget)
        if resume:
            start = self.mgr.resume(rid, num_new_tokens=want)
        else:
            start = self.mgr.admit(rid, seq.token_ids, max_tokens=seq.max_tokens,
                                   cache_salt=seq.cache_salt, num_new_tokens=want)
            if start is not None:
                seq.num_cached_tokens = start
        if start is None:
            return None
        n, ckpt = self._cut(seq, start, min(seq.num_tokens - start, budget))
        slots = self.mgr.allocate(rid, n)
        assert slots is not None, "admit/resume promised room for this chunk"
        return ScheduledChunk(seq, start, n, slots, ckpt)
