"""The engine step: schedule, build the packed batch (batch_builder.py), run the model, commit
(decodes together: `commit_decodes`), sample, append the tokens and end the sequences that stop
(token_append.py), fork n > 1 (forks.py), build the outputs asked for (request_outputs.py). A
step of steady decodes comes as one array-based DecodeBatch (step_plan.py) and runs the same
work without an object per sequence (`_run_decodes`).

Request-level API for a server: `add_request`, `step`, `abort`, `export_request` /
`import_request` (migration), `stats`. A request id names a `SequenceGroup`: a prompt and its n
sequences. Each `Sequence` owns its token list; the manager reads sampled tokens from it.

A step is a transaction per request: when committing, checkpointing, forking, sampling or
stopping fails for one request, or its logits are not finite, that request alone ends with
finish_reason "error" (the message on its outputs) and its memory is freed; the rest of the
batch goes on as if it had never been there. A failed forward pass ends every request of its
batch the same way (they cannot be told apart) and the engine serves on.

Threads: `add_request` and `abort` may be called from any thread. They are checked at once
(a refused call raises and changes nothing) and applied at once when no step runs, else at the
start of the next step. Everything else (`step`, export / import, stats) is for one thread.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from typing import Hashable, Optional

import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.models.forward_batch import ModelCaches
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot

from . import migration
from .batch_builder import BatchBuilder
from .decode_graphs import DecodeInputs
from .door import Door
from .engine_stats import engine_stats
from .forks import fork_children
from .logit_rows import PromptSpan, plan_logit_rows, prompt_logprobs
from .sampler import Sampler
from .scheduler import Scheduler
from .request_outputs import request_output
from .sequence import Sequence, SequenceGroup
from .step_plan import DecodeBatch, ScheduledChunk
from .stopping import decoded_logprobs
from .token_append import TokenAppender

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, manager: HybridCacheManager, scheduler: Scheduler, seed: int = 0):
        self.model = model
        self.mgr = manager
        self.scheduler = scheduler
        self.device = model.device
        self.sampler = Sampler(seed, eos_ids=model.eos_token_ids, device=self.device)
        self.tokenizer = getattr(model, "tokenizer", None)
        self.eos_ids = set(model.eos_token_ids)
        self.max_model_len = model.max_model_len
        self.append_tokens = TokenAppender(self.eos_ids, self.max_model_len, self.tokenizer, scheduler.finish)
        self.batch_builder = BatchBuilder(manager, self.device)
        self.decode_graphs = None  # a DecodeGraphs (decode_graphs.py) replays decode-only steps
        self.caches = ModelCaches(kv=manager.kv_caches, conv=manager.conv_states,
                                  state=manager.ssm_states, block_size=manager.block_size)
        self.door = Door(model.vocab_size, model.max_model_len, scheduler.max_seqs, manager.check_fits)
        self.groups: dict[Hashable, SequenceGroup] = {}  # by key: user ids (str) and owned keys (tuples)
        self.owned_done: dict[Hashable, RequestOutput] = {}  # finished requests of an owner (generate)
        self._inbox: list[tuple[str, object]] = []  # adds and aborts not applied yet, in call order
        self._lock = threading.Lock()       # guards groups' ids and the inbox
        self._stepping = threading.Lock()   # held while the queues and the manager change
        self._serials = itertools.count()
        self.counters = {"steps": 0, "generated_tokens": 0, "processed_tokens": 0, "model_seconds": 0.0,
                         "swaps_out": 0, "migrations_out": 0, "migrations_in": 0, "forks": 0,
                         "aborted": 0, "failed": 0, "decode_batch_steps": 0}

    # ---- requests --------------------------------------------------------------------------
    def validate(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError (TypeError for a wrong type) naming the value and the limit (door.py);
        nothing in the engine changes."""
        self.door.validate(token_ids, params, priority)

    def max_new_tokens(self, num_tokens: int, params: SamplingParams) -> int:
        return self.door.max_new_tokens(num_tokens, params)

    def add_request(self, request_id: Optional[str], token_ids: list[int], params: SamplingParams,
                    prompt: Optional[str] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, owned: bool = False) -> Hashable:
        """Queue a prompt's token ids (its n sequences fork after prefill); returns the request's
        key. A user's request is keyed by its id (a string, refused while in use); an `owned` one
        (generate's) by a tuple no user id can equal, its finished output kept in `owned_done`.
        Any thread may call this; bad input raises and changes nothing."""
        if not owned and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {request_id!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        token_ids = list(token_ids)
        self.validate(token_ids, params, priority)
        token_ids = [int(t) for t in token_ids]
        if params.prompt_logprobs is not None:
            # no prefix hit from other requests: every prompt position's logits get computed (a
            # recompute after preemption may hit its own blocks, whose logprobs are already kept)
            cache_salt = f"{cache_salt or ''}\x1fprompt_logprobs:{uuid.uuid4().hex}"
        with self._lock:
            key = ("owned", next(self._serials)) if owned else request_id
            if key in self.groups:
                raise ValueError(f"request id {request_id!r} is already in use; give another id")
            seq = Sequence(key, token_ids, params, priority=int(priority), cache_salt=cache_salt,
                           max_tokens=self.max_new_tokens(len(token_ids), params))
            g = SequenceGroup(str(request_id), prompt, params, [seq], key=key)
            g.owned = owned
            if params.prompt_logprobs is not None:
                g.prompt_logprobs = [None] * len(token_ids)
            self.groups[key] = g
            self._inbox.append(("add", seq))
            self._apply_if_idle()
        return key

    def abort(self, request_id: Hashable) -> None:
        """Stop a request and free its blocks and slots: now, or at the start of the next step when
        one is running in another thread. An unknown id is ignored."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._apply_if_idle()

    def _apply_if_idle(self) -> None:
        if self._stepping.acquire(blocking=False):
            try:
                self._apply_inbox()
            finally:
                self._stepping.release()

    def _apply_inbox(self) -> None:
        """Apply queued adds and aborts in call order (caller holds both locks)."""
        ops, self._inbox = self._inbox, []
        for op, arg in ops:
            if op == "add":
                self.scheduler.add(arg)
                continue
            g = self.groups.pop(arg, None)
            if g is None:
                continue
            for s in g.seqs:
                try:
                    self.scheduler.finish(s, "abort")
                except Exception as e:  # free what can be freed; the others still go
                    self.scheduler.fail(s, e)
            self.counters["aborted"] += 1

    def _sync(self) -> None:
        with self._lock:
            self._apply_inbox()

    def export_request(self, request_id: str) -> RequestSnapshot:
        """Freeze request `request_id` (n == 1) into a snapshot and release it from this engine."""
        with self._stepping:
            self._sync()
            g = self.groups.get(request_id) if isinstance(request_id, str) else None
            if g is None:
                raise KeyError(f"unknown request id {request_id!r}")
            snap = migration.freeze(g, self.mgr)
            del self.groups[request_id]
            self.scheduler.finish(g.seqs[0], "migrated")
            self.counters["migrations_out"] += 1
            return snap

    def import_request(self, snap: RequestSnapshot) -> None:
        """Continue a migrated request here. Raises SnapshotMismatchError for another model,
        ValueError / TypeError for a malformed snapshot, and RuntimeError when the pools or
        max_num_seqs cannot take it now; in every case nothing changed."""
        if not isinstance(snap, RequestSnapshot):
            raise TypeError(f"import_request takes a RequestSnapshot, got {type(snap).__name__}")
        with self._stepping:
            self._sync()
            rid = str(snap.req_id)
            self.door.check_snapshot(snap)
            with self._lock:  # no add_request of the same id in between
                if rid in self.groups:
                    raise ValueError(f"request id {rid!r} is already in use on this engine")
                holds = snap.num_computed_tokens > 0
                if holds and len(self.scheduler.running) >= self.scheduler.max_seqs:
                    raise RuntimeError(f"cannot import request {rid!r} now: {len(self.scheduler.running)} "
                                       f"sequences run, max_num_seqs={self.scheduler.max_seqs}; retry later")
                g, holds_memory = migration.thaw(snap, self.mgr)
                seq = g.seqs[0]
                seq.max_tokens = self.max_new_tokens(seq.num_prompt_tokens, g.params)
                if holds_memory:
                    self.scheduler.add_running(seq)
                else:  # moved as tokens: recomputed here
                    self.scheduler.add(seq)
                self.groups[rid] = g
            self.counters["migrations_in"] += 1

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Pools (blocks, slots), prefix hits and why requests missed, preemptions, tokens/s."""
        return engine_stats(self.mgr.stats(), self.counters, self.scheduler)

    # ---- the step --------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one batch; returns the outputs of the user requests that advanced or failed (only
        those that finished, with `finished_only`). Owned requests' finished outputs go to
        `owned_done`."""
        with self._stepping:
            self._sync()
            touched: dict[Hashable, SequenceGroup] = {}
            plan = self.scheduler.schedule()
            self.counters["swaps_out"] += sum(1 for _, m in plan.preempted if m == "swap")
            for seq in plan.failed:
                self._fail_group(seq, seq.error or "failed while scheduling", touched)
            if plan.decodes is not None and not plan.chunks:
                self._run_decodes(plan.decodes, touched, finished_only)
            elif plan.decodes is not None or plan.chunks:
                self._run(plan.all_chunks(), touched, finished_only)
            elif self.scheduler.has_unfinished() and not plan.preempted and not plan.failed:
                self._fail_stuck(touched)
            return self._outputs(touched, finished_only)

    def _run_decodes(self, batch: DecodeBatch, touched: dict, finished_only: bool) -> None:
        """A step of steady decodes from arrays (step_plan.py): the same work as `_run` on its
        chunks, without an object per sequence. Non-finite logits take `_run`'s rows."""
        t0 = time.perf_counter()
        seqs = batch.seqs

        def forward():
            graphs = self.decode_graphs
            if graphs is not None and graphs.bucket_for(len(batch)) is not None:
                logits = graphs.run(DecodeInputs.from_batch(batch, self.mgr))
            else:
                logits = self.model(self.batch_builder.build_decodes(batch), self.caches)
            return logits, math.isfinite(float(logits.sum()))  # NaN or inf anywhere makes the sum one

        logits, finite = self._forward(seqs, forward, touched)
        if logits is None:
            return
        if not finite:
            chunks = batch.chunks()
            logit_rows = plan_logit_rows(chunks, self._collects_prompt_logprobs)
            self._after_forward(chunks, logits, logit_rows, logit_rows.finite(logits), touched, finished_only, t0)
            return
        self._count_step(t0, len(seqs))
        self.counters["decode_batch_steps"] += 1
        mgr, failed = self.mgr, False
        with mgr.batched_checkpoints():
            errors = mgr.commit_decodes(batch.rows, batch.positions)
            for j, e in errors.items():
                self._fail_group(seqs[j], e, touched, discard=True)
            for i in batch.checkpoints:
                if (errors or failed) and seqs[i].finished:
                    continue
                try:
                    mgr.checkpoint_decode(batch.rows, i)
                except Exception as e:
                    self._fail_group(seqs[i], e, touched)
                    failed = True
        if errors or failed:  # those left sample as in the general path; the batch ends here
            keep = [j for j, s in enumerate(seqs) if not s.finished]
            if keep:
                self._sample(logits[keep], [seqs[j] for j in keep], touched, finished_only)
            return
        self._sample_batch(batch, logits, touched, finished_only)
        self.scheduler.decoded(batch)

    def _sample_batch(self, batch: DecodeBatch, logits: torch.Tensor, touched: dict, finished_only: bool) -> None:
        """_sample for a decode batch all of whose rows are left: when every row is plain greedy
        (no logprobs), one argmax and the batch's stop rules (made once per batch) instead of a
        look at each row; the tokens it samples are the next step's input ids."""
        seqs, fixed = batch.seqs, batch.fixed
        parent = fixed.pop("kept_from", None)  # (the fixed of the batch this one was cut from, its rows)
        plain = fixed.get("plain")
        if plain is None:  # rows cut from plain rows are plain
            plain = fixed["plain"] = bool(parent and parent[0].get("plain")) or self.sampler.plain(seqs)
        if not plain:
            self._sample(logits, seqs, touched, finished_only)
            return
        stops = fixed.get("stops")
        if stops is None:
            cut = parent[0].get("stops") if parent else None
            stops = fixed["stops"] = cut.keep(parent[1]) if cut is not None else self.append_tokens.batch_stops(seqs)
        try:
            sampled, tokens = self.sampler.greedy(logits)
        except Exception:  # row by row, each failing alone
            self._sample(logits, seqs, touched, finished_only)
            return
        appended, stopped = self.append_tokens.append_batch(
            seqs, tokens, stops, batch.positions + 2, lambda seq, e: self._fail_group(seq, e, touched),
            sampled.numpy() if sampled.device.type == "cpu" else None)
        batch.sampled = sampled
        self.counters["generated_tokens"] += appended
        groups = self.groups
        for seq in (stopped if finished_only else seqs):
            touched[seq.group_id] = groups[seq.group_id]

    def _forward(self, seqs: list[Sequence], forward, touched: dict) -> tuple:
        """forward()'s (logits, finite), or (None, None) when it raised: the batch cannot be told
        apart, each of its requests fails."""
        try:
            with torch.inference_mode():  # no autograd graph (it would also chain the pools across steps)
                return forward()
        except Exception as e:
            log.exception("the forward pass failed; its %d requests end with an error", len(seqs))
            for seq in seqs:
                self._fail_group(seq, f"the forward pass of its batch failed: {type(e).__name__}: {e}",
                                 touched, discard=True)
            return None, None

    def _count_step(self, t0: float, num_tokens: int) -> None:
        self.counters["model_seconds"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["processed_tokens"] += num_tokens

    def _run(self, chunks: list[ScheduledChunk], touched: dict, finished_only: bool) -> None:
        t0 = time.perf_counter()
        logit_rows = plan_logit_rows(chunks, self._collects_prompt_logprobs)
        graphs = self.decode_graphs

        def forward():
            if graphs is not None and graphs.takes(chunks, logit_rows.indices):
                logits = graphs.run(DecodeInputs.from_chunks(chunks, self.mgr))
            else:
                logits = self.model(self.batch_builder.build(chunks, logit_rows.indices), self.caches)
            return logits, logit_rows.finite(logits)

        logits, finite = self._forward([c.seq for c in chunks], forward, touched)
        if logits is None:
            return
        self._after_forward(chunks, logits, logit_rows, finite, touched, finished_only, t0)

    def _after_forward(self, chunks: list[ScheduledChunk], logits: torch.Tensor, logit_rows, finite: list[bool],
                       touched: dict, finished_only: bool, t0: float) -> None:
        """Commit, checkpoint, fork, sample and append for a step's chunks, from its logits;
        finite[i]: whether chunk i's rows are (a chunk with NaN or inf fails alone)."""
        self._count_step(t0, sum(c.num_tokens for c in chunks))
        rows, row_seqs = [], []         # the other chunks' sampling rows, in batch order
        plain_rows, plain_seqs = [], []  # decodes (ScheduledChunk.decode): committed together
        plain_checkpoints: list[Sequence] = []  # those of them due a state checkpoint
        commit, last, spans = self.mgr.commit, logit_rows.last, logit_rows.spans
        failed_before = self.counters["failed"]
        with self.mgr.batched_checkpoints():  # this step's state checkpoints copy together
            for i, c in enumerate(chunks):
                seq = c.seq
                if c.decode and finite[i]:
                    plain_rows.append(last[i])
                    plain_seqs.append(seq)
                    if c.checkpoint:
                        plain_checkpoints.append(seq)
                    continue
                if seq.finished:
                    continue  # its group failed earlier in this loop
                if not finite[i]:
                    self._fail_group(seq, "the model gave non-finite logits (NaN or inf) for this request",
                                     touched, discard=True)  # its new KV and state are suspect: cache none
                    continue
                try:
                    commit(seq.request_id, c.num_tokens)
                except Exception as e:
                    self._fail_group(seq, e, touched, discard=True)
                    continue
                try:
                    if c.checkpoint:
                        self.mgr.checkpoint(seq.request_id)
                    if spans and i in spans:
                        self._record_prompt_logprobs(seq, logits, spans[i])
                    if c.start + c.num_tokens < len(seq.token_ids):
                        continue  # a prefill chunk short of the end: nothing to sample yet
                    if seq.params.n == 1:  # no forks: the sequence samples alone
                        rows.append(last[i])
                        row_seqs.append(seq)
                        continue
                    children, made = fork_children(seq, self.groups[seq.group_id], self.scheduler, self.mgr)
                    self.counters["forks"] += made
                except Exception as e:
                    self._fail_group(seq, e, touched)
                    continue
                rows.extend([last[i]] * len(children))
                row_seqs.extend(children)
            if plain_seqs:
                plain_rows, plain_seqs = self._commit_decodes(plain_rows, plain_seqs, plain_checkpoints, touched,
                                                              self.counters["failed"] != failed_before)
                rows, row_seqs = plain_rows + rows, plain_seqs + row_seqs
        if rows:
            self._sample(logits if rows == list(range(len(logits))) else logits[rows], row_seqs, touched,
                         finished_only)

    def _commit_decodes(self, rows: list[int], seqs: list[Sequence], checkpoints: list[Sequence],
                        touched: dict, some_failed: bool) -> tuple[list[int], list[Sequence]]:
        """Commit the decodes' tokens in one manager call, then take the checkpoints due after
        them; returns the rows and sequences left to sample (a commit or checkpoint that raised
        fails its request alone, as in the per-chunk path)."""
        if some_failed:  # a sibling's failure earlier in the step may have ended some of them
            keep = [j for j, s in enumerate(seqs) if not s.finished]
            rows, seqs = [rows[j] for j in keep], [seqs[j] for j in keep]
        errors = self.mgr.commit_decodes([s.request_id for s in seqs])
        for j, e in errors.items():
            self._fail_group(seqs[j], e, touched, discard=True)
        checkpoint_failed = False
        for seq in checkpoints:
            if not seq.finished:
                try:
                    self.mgr.checkpoint(seq.request_id)
                except Exception as e:
                    self._fail_group(seq, e, touched)
                    checkpoint_failed = True
        if not errors and not checkpoint_failed:  # nobody failed here: all of them sample
            return rows, seqs
        keep = [j for j, s in enumerate(seqs) if not s.finished]
        return [rows[j] for j in keep], [seqs[j] for j in keep]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict, finished_only: bool) -> None:
        """Sample a token for each row [R, V] and append it to seqs[row]; a row whose sampling or stop
        check raises fails its request alone (rows are redone one by one, so the others keep their
        draws). touched gets the groups that advanced (with finished_only: that finished)."""
        state = self.sampler.state()
        try:
            tokens, logprobs = self.sampler(logits, seqs)  # a Sequence reads as a SampleRow
        except Exception:
            self.sampler.set_state(state)
            tokens, logprobs = [], []
            for i, seq in enumerate(seqs):
                try:
                    tok, lp = self.sampler(logits[i:i + 1], [seq])
                    tokens.append(tok[0])
                    logprobs.append(lp[0])
                except Exception as e:
                    tokens.append(e)
                    logprobs.append(None)
        appended, stopped = self.append_tokens(seqs, tokens, logprobs,
                                               lambda seq, e: self._fail_group(seq, e, touched))
        self.counters["generated_tokens"] += appended
        groups = self.groups
        for seq in (stopped if finished_only else seqs):
            touched[seq.group_id] = groups[seq.group_id]

    def _fail_group(self, seq: Sequence, error, touched: dict, discard: bool = False) -> None:
        """End the request `seq` belongs to with "error": every unfinished sequence of it.
        discard: this step ran past what the manager committed for it (see Scheduler.fail)."""
        g = self.groups.get(seq.group_id)
        seqs = g.seqs if g is not None else [seq]
        message = seq.error or (f"{type(error).__name__}: {error}" if isinstance(error, BaseException)
                                else str(error))
        for s in seqs:
            self.scheduler.fail(s, message if s is seq else f"another sequence of this request failed: "
                                f"{message}", discard=discard)
        if g is not None:
            g.failed = True
            touched[g.key] = g
        self.counters["failed"] += 1

    def _fail_stuck(self, touched: dict) -> None:
        """Nothing ran and nothing was preempted: the head of the queue cannot fit even an idle
        engine (checked at the door, so this is a bug); it fails so the rest can go on."""
        q = self.scheduler.swapped or self.scheduler.waiting
        head = q.peek()
        if head is None:
            return
        self._fail_group(head, f"the scheduler could not fit it in the pools; stats: {self.mgr.stats()}",
                         touched)

    def _collects_prompt_logprobs(self, seq: Sequence) -> bool:
        g = self.groups.get(seq.group_id)
        return g is not None and g.prompt_logprobs is not None and seq.seq_index == 0

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, span: PromptSpan) -> None:
        g = self.groups[seq.group_id]
        for j, entry in enumerate(prompt_logprobs(logits, seq.token_ids, span, g.params.prompt_logprobs)):
            g.prompt_logprobs[span.pos0 + 1 + j] = decoded_logprobs(self.tokenizer, entry)

    def _outputs(self, touched: dict, finished_only: bool) -> list[RequestOutput]:
        outs = []
        for g in touched.values():
            done = g.finished
            if finished_only and not done:
                continue
            try:
                out = request_output(g, done, self.tokenizer)
            except Exception as e:  # building its output failed: it ends, the others still report
                for s in g.seqs:
                    self.scheduler.fail(s, e)
                out = request_output(g, g.finished, self.tokenizer)
            if out.finished:
                with self._lock:
                    self.groups.pop(g.key, None)
            if g.owned:
                if out.finished:
                    self.owned_done[g.key] = out
            else:
                outs.append(out)
        return outs
