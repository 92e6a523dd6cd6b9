"""The engine step: `scheduler.schedule()` -> `executor.execute()` -> `results.apply()`,
then the outputs asked for (request_outputs.py).

The scheduler (scheduler.py) makes the plan's memory-manager calls: admission, allocation,
preemption; its `StepResults` (step_results.py) after the forward pass the commits, state
checkpoints and forks, and appends the sampled tokens; the model runner
(model_runner.py) builds the batch, runs the model, checks the logits and samples, and never
changes the manager. The engine only sequences them and keeps the request-level API for a
server: `add_request`, `step`, `abort`, `export_request` / `import_request` (migration), `stats`.
A request id names a `RequestGroup`: a prompt and its n sequences. Each `Request` owns its
token list; the manager reads sampled tokens from it.

A step is a transaction per request: when committing, checkpointing, forking, sampling or
stopping fails for one request, or its logits are not finite, that request alone ends with
finish_reason "error" (the message on its outputs) and its memory is freed; the rest of the
batch goes on as if it had never been there. A failed forward pass ends every request of its
batch the same way (they cannot be told apart) and the engine serves on.

Threads: `add_request` and `abort` may be called from any thread (request_inbox.py). They are
checked at once (a refused call raises and changes nothing) and applied at once when no step
runs, else at the start of the next step. Everything else (`step`, export / import, stats) is
for one thread.
"""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Callable, Hashable, Optional

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import SnapshotMismatchError
from hybridkv.outputs import RequestOutput
from hybridkv.request import Request
from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot

from . import migration
from .request_validation import RequestValidator
from .engine_stats import engine_stats
from .model_runner import ModelRunner, RunnerOutput
from .request_inbox import RequestInbox
from .request_outputs import request_output
from .scheduler import Scheduler
from .step_results import StepResults
from .request_group import RequestGroup
from .token_append import TokenAppender

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, manager: HybridCacheManager, scheduler: Scheduler, seed: int = 0,
                 executor: Optional[Callable[[ModelRunner], object]] = None, quantize_stochastic: bool = False):
        """executor: given the model runner, what executes each step (`execute(output, groups)`;
        tensor parallelism: hybridkv/parallel/executor.py); None: the runner itself.
        quantize_stochastic: quantized pools round int8 codes stochastically (ModelRunner)."""
        self.mgr = manager
        self.scheduler = scheduler
        self.runner = ModelRunner(model, manager, seed, quantize_stochastic)
        self.executor = executor(self.runner) if executor is not None else self.runner
        self.tokenizer = getattr(model, "tokenizer", None)
        self.max_model_len = model.max_model_len
        self.results = StepResults(scheduler, TokenAppender(set(model.eos_token_ids), self.max_model_len,
                                                            self.tokenizer, scheduler.finish))
        self.validator = RequestValidator(model.vocab_size, model.max_model_len, scheduler.max_seqs, manager.check_fits)
        self.groups = scheduler.groups  # by key: user ids (str) and generate's keys (tuples)
        self.generate_done: dict[Hashable, RequestOutput] = {}  # finished requests added by generate
        self.inbox = RequestInbox(self._apply)
        self._serials = itertools.count()
        self._counts = {"steps": 0, "processed_tokens": 0, "swaps_out": 0, "migrations_out": 0,
                        "migrations_in": 0, "aborted": 0}

    @property
    def counters(self) -> dict:
        """The engine's, the scheduler's and the runner's counters in one dict (a copy)."""
        spec, guard = self.scheduler.speculation, self.scheduler.hit_guard
        return {**self._counts, **self.scheduler.counters, **(spec.all_counters() if spec is not None else {}),
                **(guard.counters if guard is not None else {}),
                "model_seconds": self.runner.model_seconds}

    # ---- requests --------------------------------------------------------------------------
    def validate(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError (TypeError for a wrong type) naming the value and the limit (request_validation.py);
        nothing in the engine changes."""
        self.validator.validate(token_ids, params, priority)

    def max_new_tokens(self, num_tokens: int, params: SamplingParams) -> int:
        return self.validator.max_new_tokens(num_tokens, params)

    def add_request(self, request_id: Optional[str], token_ids: list[int], params: SamplingParams,
                    prompt: Optional[str] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, for_generate: bool = False) -> Hashable:
        """Queue a prompt's token ids (its n sequences fork after prefill); returns the request's
        key. A user's request is keyed by its id (a string, refused while in use); a `for_generate` one
        (generate's) by a tuple no user id can equal, its finished output kept in `generate_done`.
        Any thread may call this; bad input raises and changes nothing."""
        if not for_generate and not isinstance(request_id, str):
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
        with self.inbox.lock:
            key = ("generate", next(self._serials)) if for_generate else request_id
            if key in self.groups:
                raise ValueError(f"request id {request_id!r} is already in use; give another id")
            seq = Request(key, token_ids, params, priority=int(priority), cache_salt=cache_salt,
                           max_tokens=self.max_new_tokens(len(token_ids), params))
            g = RequestGroup(str(request_id), prompt, params, [seq], key=key)
            g.for_generate = for_generate
            if params.prompt_logprobs is not None:
                g.prompt_logprobs = [None] * len(token_ids)
            self.groups[key] = g
            self.inbox.put("add", seq)
        return key

    def abort(self, request_id: Hashable) -> None:
        """Stop a request and free its blocks and slots: now, or at the start of the next step when
        one is running in another thread. An unknown id is ignored."""
        with self.inbox.lock:
            self.inbox.put("abort", request_id)

    def _apply(self, ops: list[tuple[str, object]]) -> None:
        """Apply queued adds and aborts in call order (the inbox holds both locks)."""
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
            self._counts["aborted"] += 1

    def export_request(self, request_id: str) -> RequestSnapshot:
        """Freeze request `request_id` (n == 1) into a snapshot and release it from this engine."""
        with self.inbox.step():
            g = self.groups.get(request_id) if isinstance(request_id, str) else None
            if g is None:
                raise KeyError(f"unknown request id {request_id!r}")
            snap = migration.export_request(self.scheduler, g)
            self._counts["migrations_out"] += 1
            return snap

    def import_request(self, snap: RequestSnapshot) -> None:
        """Continue a migrated request here. Raises SnapshotMismatchError for a snapshot that
        cannot continue here (another model, a malformed field, sampling state or tensor, an id in
        use: the whole schema is checked before anything is allocated), RuntimeError when the
        pools or max_num_seqs cannot take it now (retry later); in every case nothing changed."""
        with self.inbox.step():
            params = self.validator.check_snapshot(snap)
            rid = snap.req_id
            with self.inbox.lock:  # no add_request of the same id in between
                if rid in self.groups:
                    raise SnapshotMismatchError(f"snapshot request id {rid!r} is already in use on this engine")
                holds = snap.num_computed_tokens > 0
                if holds and len(self.scheduler.running) >= self.scheduler.max_seqs:
                    raise RuntimeError(f"cannot import request {rid!r} now: {len(self.scheduler.running)} "
                                       f"sequences run, max_num_seqs={self.scheduler.max_seqs}; retry later")
                migration.import_request(self.scheduler, snap, params, self.validator.max_new_tokens)
            self._counts["migrations_in"] += 1

    def has_unfinished(self) -> bool:
        return bool(self.inbox) or self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Pools (blocks, slots), prefix hits and why requests missed, preemptions, tokens/s."""
        return engine_stats(self.mgr.stats(), self.counters, self.scheduler)

    # ---- the step --------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one batch; returns the outputs of the user requests that advanced or failed (only
        those that finished, with `finished_only`). Owned requests' finished outputs go to
        `generate_done`."""
        with self.inbox.step():
            sched, spec = self.scheduler, self.scheduler.speculation
            if spec is not None:  # what the step costs, for speculation's cost model (off: not measured)
                started, generated = time.perf_counter(), sched.counters["generated_tokens"]
            out = sched.schedule()
            self._counts["swaps_out"] += sum(1 for _, m in out.preempted if m == "swap")
            if out.decodes is not None or out.chunks:
                result = self.executor.execute(out, sched.groups)
                if result.error is None:
                    self._counts["steps"] += 1
                    self._counts["processed_tokens"] += out.num_tokens
            else:
                result = RunnerOutput()
                self.runner.loads.settle()  # (an import's loads: nothing stays pending across steps)
            reported = self.results.apply(out, result, finished_only)
            if spec is not None:
                spec.step_done(out, sched.counters["generated_tokens"] - generated, time.perf_counter() - started)
            return self._outputs(reported, finished_only)

    def _outputs(self, reported: dict, finished_only: bool) -> list[RequestOutput]:
        outs = []
        for g in reported.values():
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
                with self.inbox.lock:
                    self.groups.pop(g.key, None)
            if g.background:
                continue
            if g.for_generate:
                if out.finished:
                    self.generate_done[g.key] = out
            else:
                outs.append(out)
        return outs
