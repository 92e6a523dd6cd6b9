"""A computed step applied to its requests (docs/design.md, "The step").

After the forward pass, `StepResults.apply` takes what the model runner computed for the
scheduler's plan (step_plan.py's `SchedulerOutput`) and applies it: the manager's commits, the
state checkpoints due, the forks of an n > 1 request (`_fork`), draft runs (speculation.py), then
the sampled tokens appended through the model's stop rules (token_append.py) and the sequences
that stop ended. A failure in any of these ends its request alone (`fail_request`: every sequence
of its group); a step in which nothing could run fails the head of the queue (`_fail_stuck`).
The queues, the requests' groups and the counters are the scheduler's (scheduler.py); a decode
batch run and committed whole goes back to it (`Scheduler.last_batch`) for the next plan.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Hashable

import numpy as np

from hybridkv.request import Request

from .model_runner import NONFINITE, RunnerOutput
from .request_group import RequestGroup
from .scheduler import Scheduler
from .step_plan import DecodeBatch, ScheduledChunk, SchedulerOutput
from .token_append import TokenAppender


class StepResults:
    def __init__(self, scheduler: Scheduler, appender: TokenAppender):
        """scheduler: whose plan the results are for (its manager, queues, groups and counters);
        appender: the model's stop rules, ending a sequence through `scheduler.finish`."""
        self.sched = scheduler
        self.appender = appender

    def apply(self, out: SchedulerOutput, result: RunnerOutput, finished_only: bool = False
              ) -> dict[Hashable, RequestGroup]:
        """Apply a computed step: commit its tokens, take the state checkpoints due, fork n > 1,
        append the sampled tokens and end the sequences that stop. A failure in any of these ends
        its request alone. Returns {key: group} of the requests that advanced or ended (with
        finished_only: that ended)."""
        sched = self.sched
        reported: dict[Hashable, RequestGroup] = {}
        for seq in out.failed:
            self.fail_request(seq, seq.error or "failed while scheduling", reported)
        e = result.error
        if e is not None:
            for seq in out.seqs():
                self.fail_request(seq, f"the forward pass of its batch failed: {type(e).__name__}: {e}",
                                  reported, discard=True)
            return reported
        if result.kept_logits:
            sched.hit_guard.observe(result.kept_logits)
        if result.drafts:  # the target's MTP head proposed these in the forward pass (speculative/mtp.py)
            sched.speculation.drafter.record(result.drafts)
        checkpoints = out.chunks or (out.decodes is not None and out.decodes.checkpoints)
        with sched.mgr.prefix_cache.batched_checkpoints() if checkpoints else nullcontext():  # they copy together
            if out.decodes is not None:
                self._update_batch(out.decodes, result, reported, finished_only, bool(out.failed))
            if out.chunks:
                self._update_chunks(out.chunks, result, reported, finished_only)
        if sched.speculation is not None and out.chunks:  # outside: their checkpoints read draft slots
            sched.speculation.commit_runs(
                sched.mgr, out.chunks, result, lambda seq, e: self.fail_request(seq, e, reported, discard=True),
                lambda seqs, tokens, lps: self._append(seqs, tokens, lps, reported, finished_only))
        if not (out.decodes or out.chunks or out.preempted or out.failed or out.held) and sched.has_unfinished():
            self._fail_stuck(reported)
        return reported

    def _update_batch(self, batch: DecodeBatch, result: RunnerOutput, reported: dict, finished_only: bool,
                      some_failed: bool) -> None:
        """The decode batch: a row with non-finite logits fails alone; the others commit in one
        manager call, take their checkpoints, and append their tokens (all greedy: through the
        batch's stop rules). A batch run and committed whole may be carried to the next step.
        some_failed: a request failed while scheduling (its siblings in the batch ended with it)."""
        seqs = batch.seqs
        self.sched.counters["decode_batch_steps"] += batch.whole  # a steady step: every running request decoded
        finite = result.batch_finite
        if finite is not None:
            for j in np.flatnonzero(~np.asarray(finite)).tolist():
                if not seqs[j].finished:  # (a sibling's failure may have ended it)
                    self.fail_request(seqs[j], NONFINITE, reported, discard=True)  # its new KV and state are suspect
        ran_whole = batch.commit(finite is not None or some_failed,
                                 lambda j, e, discard: self.fail_request(seqs[j], e, reported, discard=discard))
        tokens = result.batch_tokens
        if not ran_whole:  # those left append one by one; the batch ends here
            keep = [j for j, seq in enumerate(seqs) if not seq.finished]
            lps = result.batch_logprobs or [None] * len(seqs)
            self._append([seqs[j] for j in keep], [tokens[j] for j in keep], [lps[j] for j in keep],
                         reported, finished_only)
            return
        if result.sampled is None:  # not all greedy (or its argmax failed): row by row
            self._append(seqs, tokens, result.batch_logprobs, reported, finished_only)
        else:
            if batch.stops is None:
                batch.stops = self.appender.batch_stops(seqs)
            appended, stopped = self.appender.append_batch(
                seqs, tokens, batch.stops, batch.positions + 2, lambda seq, e: self.fail_request(seq, e, reported),
                result.sampled_np)
            batch.sampled = result.sampled
            self._advanced_by(appended, stopped if finished_only else seqs, reported)
        if batch.whole:
            self.sched.last_batch = batch  # the next step may carry it over

    def _update_chunks(self, chunks: list[ScheduledChunk], result: RunnerOutput, reported: dict,
                       finished_only: bool) -> None:
        """Commit, checkpoint, fork and append for a step's chunks; one with NaN or inf fails alone."""
        seqs, tokens, lps = [], [], []  # the sampled rows, in batch order
        mgr = self.sched.mgr
        for i, c in enumerate(chunks):
            seq = c.seq
            if seq.finished or c.draft:
                continue  # its group failed earlier in this step; a draft run: Speculation.commit_runs
            if not result.finite[i]:
                self.fail_request(seq, NONFINITE, reported, discard=True)  # its new KV and state are suspect
                continue
            try:
                mgr.commit(seq.request_id, c.num_tokens)
            except Exception as e:
                self.fail_request(seq, e, reported, discard=True)
                continue
            try:
                if c.checkpoint:
                    mgr.prefix_cache.checkpoint(seq.request_id)
                if i in result.prompt_logprobs:
                    self.sched.groups[seq.group_id].record_prompt_logprobs(*result.prompt_logprobs[i],
                                                                           self.appender.tokenizer)
                if i not in result.tokens:
                    continue  # a prefill chunk short of the end: nothing sampled yet
                children = self._fork(seq)
            except Exception as e:
                self.fail_request(seq, e, reported)
                continue
            for s, j in [(seq, 0), *children]:  # a fork's draw is the j-th of its parent's row
                seqs.append(s)
                tokens.append(result.tokens[i][j])
                lps.append(result.logprobs[i][j])
        self._append(seqs, tokens, lps, reported, finished_only)

    def _append(self, seqs: list[Request], tokens: list, lps: list, reported: dict, finished_only: bool) -> None:
        appended, stopped = self.appender(seqs, tokens, lps, lambda seq, e: self.fail_request(seq, e, reported))
        self._advanced_by(appended, stopped if finished_only else seqs, reported)

    def _advanced_by(self, appended: int, seqs: list[Request], reported: dict) -> None:
        self.sched.counters["generated_tokens"] += appended
        groups = self.sched.groups
        for seq in seqs:
            reported[seq.group_id] = groups[seq.group_id]

    # ---- n > 1 ------------------------------------------------------------------------------
    def _fork(self, parent: Request) -> list[tuple[Request, int]]:
        """Make the request's pending siblings once its first sequence finished its prompt. A fork
        shares the parent's blocks and starts from a copy of its state (the manager's `fork`), so
        it takes its draw from the parent's row this step; one that finds no state slot or no seat
        waits in the queue and prefills on its own (a prefix hit on the parent's blocks).
        Returns (fork, its draw's index in the parent's row) of the forks that run now."""
        sched = self.sched
        g, out = sched.groups.get(parent.group_id), []
        for k, child in enumerate(g.make_forks(parent) if g is not None else [], start=1):
            if len(sched.running) < sched.max_seqs and sched.mgr.fork(parent.request_id, child):
                sched.add_running(child)
                sched.counters["forks"] += 1
                out.append((child, k))
            else:
                sched.add(child)
        return out

    # ---- failures ---------------------------------------------------------------------------
    def fail_request(self, seq: Request, error, reported: dict, discard: bool = False) -> None:
        """End the request `seq` belongs to with "error": every unfinished sequence of it.
        discard: this step ran past what the manager committed for it (see `Scheduler.fail`)."""
        sched = self.sched
        g = sched.groups.get(seq.group_id)
        message = seq.error or (f"{type(error).__name__}: {error}" if isinstance(error, BaseException)
                                else str(error))
        for s in (g.seqs if g is not None else [seq]):
            sched.fail(s, message if s is seq else f"another sequence of this request failed: {message}",
                       discard=discard)
        if g is not None:
            g.failed = True
            reported[g.key] = g
        sched.counters["failed"] += 1

    def _fail_stuck(self, reported: dict) -> None:
        """Nothing ran and nothing was preempted: the head of the queue cannot fit even an idle
        engine (checked when it was added, so this is a bug); it fails so the rest can go on."""
        sched = self.sched
        head = (sched.swapped or sched.waiting).peek()
        if head is not None:
            self.fail_request(head, f"the scheduler could not fit it in the pools; stats: {sched.mgr.stats()}",
                              reported)
