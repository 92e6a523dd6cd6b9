"""The model runner: one step's forward pass and sampling, for what the scheduler scheduled.

It owns the model, the batch builder (batch_builder.py), the CUDA graphs (decode_graphs.py)
and the sampler (sampler.py); it reads the manager's block tables and slots to build a batch
and never changes the manager (the scheduler does, and after the pass `StepResults.apply`).

`execute(scheduler_output)` is `run(prepare(scheduler_output))`: `prepare` builds the model's
inputs over the decode batch's rows then the chunks (a `StepInputs`: what a tensor-parallel
executor sends the other ranks, hybridkv/parallel/executor.py), `run` runs the forward pass,
checks the logits for NaN / inf (one sum for a decode batch alone; per row or chunk otherwise)
and samples every row that needs a token: each decode row, the last row of each chunk that
reaches its sequence's end, once more for each fork a request with n > 1 makes at that point
(its rows' draws depend only on the seed, the index and the step: sampler.py); a decode batch
alone of greedy rows (no logprobs) in one argmax. A row whose sampling raises gets the
exception as its token, so that request alone fails.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

import numpy as np
import torch

from hybridkv.layer_loads import LoadedLayers
from hybridkv.models.forward_batch import ForwardBatch, ModelCaches

from .batch_builder import BatchBuilder
from .cache_staging import CacheStaging
from .decode_graphs import DecodeInputs
from .logit_rows import LogitRows, plan_logit_rows, prompt_logprobs
from .sampler import SampleRow, Sampler
from .step_plan import DecodeBatch, ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)

# Why a request whose logits row is not finite fails (its new KV and state are suspect).
NONFINITE = "the model gave non-finite logits (NaN or inf) for this request"


@dataclass
class RunnerOutput:
    """What the model computed for one SchedulerOutput.

    error: the forward pass raised (its requests cannot be told apart: each fails).
    chunks: the step's chunks (SchedulerOutput.chunks), in batch order after the decode rows.
    finite: per chunk, whether its rows are finite.
    tokens / logprobs: per chunk, the tokens sampled from its last row (the sequence's, then one
        per fork made there; an entry may be the exception its draw raised) and their logprobs;
        for a chunk that verifies a draft, its accepted run: the draft tokens its positions drew
        in order, then the first token that differs from the draft (or follows all of it).
    prompt_logprobs: {chunk index: (first position, per prompt position from there {token id:
        Logprob})} for the chunks that collect prompt logprobs.
    kept_logits: {request id: raw logits [vocab], float32} of the sampled row of each chunk marked
        `keep_logits` that reached its sequence's end (the prefix-hit guard, hit_guard.py).
    batch_tokens: the decode batch's tokens, one per row (list of ints, or of ints and
        exceptions when not greedy; None for a row whose logits are not finite), with
        `batch_logprobs`; `batch_finite`: per row whether its logits are finite (None: all);
        `sampled` / `sampled_np`: a decode batch alone all greedy: the argmax as a tensor [R]
        (the next step's input ids) and a numpy view on the CPU.
    drafts: with the target's MTP head (speculative method 'mtp'), its proposal for each sequence
        that sampled: {request id: (the index the proposed token would take, token)}.
    """

    error: Optional[BaseException] = None
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finite: list[bool] = field(default_factory=list)
    tokens: dict[int, list] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)
    kept_logits: dict = field(default_factory=dict)
    batch_tokens: Optional[list] = None
    batch_logprobs: Optional[list] = None
    batch_finite: Optional[list[bool]] = None
    sampled: Optional[torch.Tensor] = None
    sampled_np: Optional[np.ndarray] = None
    drafts: dict = field(default_factory=dict)


@dataclass
class StepInputs:
    """One SchedulerOutput's model inputs (`ModelRunner.prepare`): a ForwardBatch, or a CUDA
    graph's inputs when a graph replays the step; error: building them raised (the step's
    requests fail). chunks / rows: the step's chunks (the decode batch's rows first, in chunk form)
    and their logit rows (None for a decode batch alone)."""

    out: SchedulerOutput
    fork_rows: Callable
    started: float
    batch: Optional[ForwardBatch] = None
    graph_inputs: Optional[DecodeInputs] = None
    chunks: Optional[list[ScheduledChunk]] = None
    rows: Optional[LogitRows] = None
    error: Optional[BaseException] = None


class ModelRunner:
    """Runs `model` over `manager`'s pools on the model's device; `seed` seeds the draws of
    unseeded rows. `decode_graphs`: a DecodeGraphs that replays decode-only steps (set after
    capture), or None."""

    def __init__(self, model, manager, seed: int = 0, quantize_stochastic: bool = False):
        self.model = model
        self.device = model.device
        self.mgr = manager  # read only: block tables and slots for the batch
        self.sampler = Sampler(seed, eos_ids=model.eos_token_ids, device=self.device)
        self.batch_builder = BatchBuilder(manager, self.device)
        # the pools as the model reads them: each layer's pending loads done before it runs (layer_loads.py)
        self.loads = manager.loads
        self.caches = ModelCaches(kv=LoadedLayers(manager.kv_caches, self.loads),
                                  conv=LoadedLayers(manager.conv_states, self.loads),
                                  state=LoadedLayers(manager.ssm_states, self.loads), block_size=manager.block_size)
        # Quantized pools: each step's rows decoded for the model and encoded back (cache_staging.py)
        staging = CacheStaging(manager, quantize_stochastic, seed)
        self.staging = staging if staging.active else None
        self.decode_graphs = None
        self.model_seconds = 0.0
        self.has_mtp = getattr(model, "mtp", None) is not None  # a head to run after each step (mtp_head.py)
        # how many tokens the head proposes for a request id (chained past the first): LLM hands
        # the speculation's next k (scheduler/speculation.py, Speculation.next_k; read only)
        self.mtp_tokens: Callable[[Hashable], int] = lambda request_id: 1

    def execute(self, out: SchedulerOutput, groups: dict) -> RunnerOutput:
        """Forward and sample for `out`; groups: the requests by key (read only: which collect
        prompt logprobs, which make forks when their prompt is done)."""
        return self.run(self.prepare(out, groups))

    def prepare(self, out: SchedulerOutput, groups: dict) -> StepInputs:
        """The model's inputs for `out` (built from the manager's tables; nothing runs yet)."""
        def collects_prompt_logprobs(seq) -> bool:
            return groups[seq.group_id].collects_prompt_logprobs(seq)

        def fork_rows(seq) -> list:
            return groups[seq.group_id].fork_rows(seq)

        step = StepInputs(out, fork_rows, time.perf_counter())
        graphs = self.decode_graphs
        try:
            with torch.inference_mode():  # the batch's buffers are inference tensors, as the forward's
                if out.decodes is not None and not out.chunks:
                    if graphs is not None and graphs.bucket_for(len(out.decodes)) is not None:
                        step.graph_inputs = DecodeInputs.from_batch(out.decodes, self.mgr)
                    else:
                        step.batch = self.batch_builder.build_decodes(out.decodes)
                    return step
                step.chunks = out.all_chunks()
                step.rows = plan_logit_rows(step.chunks, collects_prompt_logprobs)
                if graphs is not None and graphs.takes(step.chunks, step.rows.indices):
                    step.graph_inputs = DecodeInputs.from_chunks(step.chunks, self.mgr)
                else:
                    step.batch = self.batch_builder.build(step.chunks, step.rows.indices)
        except Exception as e:
            step.error = e
        return step

    def run(self, step: StepInputs) -> RunnerOutput:
        """The forward pass over `step`, the logits checked and sampled."""
        try:
            if step.error is not None:
                raise step.error
            with torch.inference_mode():  # no autograd graph (it would also chain the pools across steps)
                try:
                    if step.graph_inputs is not None:
                        self.loads.settle()  # a replay runs no Python per layer (nor waits inside a capture)
                        logits = self.decode_graphs.run(step.graph_inputs)
                    elif self.staging is not None:
                        batch, caches, store = self.staging.stage(step.batch, self.caches)
                        logits = self.model(batch, caches)
                        store()
                    else:
                        logits = self.model(step.batch, self.caches)
                finally:
                    self.loads.settle()  # what no layer read (a failed forward's rest): nothing stays pending
            if step.rows is None:
                result = self._decode_batch(step.out.decodes, logits)
            else:
                result = self._sampled(step.chunks, logits, step.rows, step.rows.finite(logits), step.fork_rows)
            if self.has_mtp:
                with torch.inference_mode():
                    result.drafts = self._mtp_drafts(step, result)
            if step.rows is not None and step.out.decodes is not None:
                result = self._split(result, step.out)
        except Exception as e:
            log.exception("the forward pass failed; its %d requests end with an error", step.out.num_seqs)
            result = RunnerOutput(error=e)
        self.model_seconds += time.perf_counter() - step.started
        return result

    # ---- after the forward -----------------------------------------------------------------
    def _decode_batch(self, batch: DecodeBatch, logits: torch.Tensor) -> RunnerOutput:
        """A decode batch alone: its rows' tokens (one argmax when all greedy); with NaN or inf
        anywhere, which rows are finite and only theirs drawn."""
        if not math.isfinite(float(logits.sum())):  # NaN or inf anywhere makes the sum one
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            out = RunnerOutput(batch_finite=finite)
            idx = [i for i, ok in enumerate(finite) if ok]
            out.batch_tokens, out.batch_logprobs = [None] * len(batch), [None] * len(batch)
            if idx:
                tokens, lps = self._sample_rows(logits[idx], [batch.seqs[i] for i in idx])
                for i, tok, lp in zip(idx, tokens, lps):
                    out.batch_tokens[i], out.batch_logprobs[i] = tok, lp
            return out
        out = RunnerOutput()
        if batch.all_greedy is None:
            batch.all_greedy = self.sampler.all_greedy(batch.seqs)
        if batch.all_greedy:
            try:
                sampled, tokens = self.sampler.greedy(logits)
            except Exception:  # row by row, each failing alone
                out.batch_tokens, out.batch_logprobs = self._sample_rows(logits, batch.seqs)
                return out
            out.batch_tokens, out.sampled = tokens, sampled
            out.sampled_np = sampled.numpy() if sampled.device.type == "cpu" else None
        else:
            out.batch_tokens, out.batch_logprobs = self._sample_rows(logits, batch.seqs)
        return out

    @staticmethod
    def _split(both: RunnerOutput, out: SchedulerOutput) -> RunnerOutput:
        """The result over the decode batch's rows (in chunk form, first) and the chunks, as the
        batch's per-row fields and the chunks' per-chunk ones."""
        r = len(out.decodes)
        split = RunnerOutput(chunks=out.chunks, finite=both.finite[r:],
                             tokens={i - r: t for i, t in both.tokens.items() if i >= r},
                             logprobs={i - r: t for i, t in both.logprobs.items() if i >= r},
                             prompt_logprobs={i - r: t for i, t in both.prompt_logprobs.items() if i >= r},
                             kept_logits=both.kept_logits, drafts=both.drafts)
        split.batch_tokens = [both.tokens[i][0] if i in both.tokens else None for i in range(r)]
        split.batch_logprobs = [both.logprobs[i][0] if i in both.logprobs else None for i in range(r)]
        if not all(both.finite[:r]):
            split.batch_finite = both.finite[:r]
        return split

    def _mtp_drafts(self, step: StepInputs, result: RunnerOutput) -> dict:
        """The target's MTP head after the forward (models/mtp_head.py), over every position
        the step computed, each reading the token after it: the prompt's next token, the draft or
        accepted token of a verifying run, or what this step sampled (a position whose next token
        is unknown reads 0: it was rejected, or its request fails). Returns the proposal for each
        sequence that sampled, read at its last kept position, chained to `mtp_tokens(its id)`:
        {request id: (the index its first token would take, [tokens])}."""
        nxt, rows, owners = [], [], []
        if step.chunks is None:  # a decode batch alone: one row a sequence, its next token its draw
            for i, (seq, tok) in enumerate(zip(step.out.decodes.seqs, result.batch_tokens)):
                ok = tok.__class__ is int
                nxt.append(tok if ok else 0)
                if ok:
                    rows.append(i)
                    owners.append((seq.request_id, len(seq.token_ids) + 1))
        else:
            at = 0
            for i, c in enumerate(step.chunks):
                seq, n = c.seq, c.num_tokens
                drawn = result.tokens.get(i, [])
                run = drawn if c.draft else drawn[:1]  # the sequence's own tokens (not its forks')
                if not all(t.__class__ is int for t in run):
                    run = []
                ids = list(run) if c.draft else seq.token_ids[c.start + 1:c.start + n + 1] + run
                nxt.extend(ids[:n] + [0] * (n - len(ids)))
                if run:
                    rows.append(at + (len(run) - 1 if c.draft else n - 1))
                    owners.append((seq.request_id, len(seq.token_ids) + len(run)))
                at += n
        ids = torch.tensor(nxt, dtype=torch.long).to(self.device)
        steps = [self.mtp_tokens(rid) for rid, _ in owners]
        drafts = self.model.mtp_drafts(step.batch, self.caches, ids, rows, steps)
        return {rid: (index, d) for (rid, index), d in zip(owners, drafts)}

    # ---- sampling --------------------------------------------------------------------------
    def _sampled(self, chunks: list[ScheduledChunk], logits: torch.Tensor, rows: LogitRows,
                 finite: list[bool], fork_rows) -> RunnerOutput:
        """Sample the last row of each finite chunk that reaches its sequence's end (and its forks'
        rows); compute the prompt logprobs asked."""
        out = RunnerOutput(chunks=chunks, finite=finite)
        idx, sample_rows, owners = [], [], []
        for i, c in enumerate(chunks):
            if not finite[i]:
                continue
            seq = c.seq
            if rows.spans and i in rows.spans:
                span = rows.spans[i]
                out.prompt_logprobs[i] = (span.pos0, prompt_logprobs(logits, seq.token_ids, span,
                                                                     seq.params.prompt_logprobs))
            if c.draft:  # a row per position, each drawn as that position's plain decode would be
                these = draft_sample_rows(seq, c.draft)
                first = rows.drafts[i]
                idx.extend(range(first, first + len(these)))
                sample_rows.extend(these)
                owners.extend([i] * len(these))
                continue
            if c.start + c.num_tokens < len(seq.token_ids):
                continue  # a prefill chunk short of the end: nothing to sample yet
            these = [seq] if c.decode else [seq, *fork_rows(seq)]
            if c.keep_logits:
                out.kept_logits[seq.request_id] = logits[rows.last[i]].float().clone()
            idx.extend([rows.last[i]] * len(these))
            sample_rows.extend(these)
            owners.extend([i] * len(these))
        if not sample_rows:
            return out
        tokens, logprobs = self._sample_rows(logits if idx == list(range(len(logits))) else logits[idx],
                                             sample_rows)
        for i, tok, lp in zip(owners, tokens, logprobs):
            out.tokens.setdefault(i, []).append(tok)
            out.logprobs.setdefault(i, []).append(lp)
        for i, c in enumerate(chunks):
            if c.draft and i in out.tokens:
                n = accepted_run(out.tokens[i], c.draft)
                del out.tokens[i][n:], out.logprobs[i][n:]
        return out

    def _sample_rows(self, logits: torch.Tensor, rows: list) -> tuple[list, list]:
        """A token per row [R, V] (rows: SampleRows or Sequences); when the batched draw raises,
        the rows are redone one by one so the others keep their draws and a failing row gets the
        exception as its token."""
        state = self.sampler.state()
        try:
            return self.sampler(logits, rows)
        except Exception:
            self.sampler.set_state(state)
        tokens, logprobs = [], []
        for i, row in enumerate(rows):
            try:
                tok, lp = self.sampler(logits[i:i + 1], [row])
                tokens.append(tok[0])
                logprobs.append(lp[0])
            except Exception as e:
                tokens.append(e)
                logprobs.append(None)
        return tokens, logprobs


def draft_sample_rows(seq, draft) -> list:
    """What the sampler reads for each position of seq's draft run: the sequence itself for its
    last token, then as if draft[:j] had been appended (its count of generated tokens, which
    seeds a seeded draw and gates min_tokens; the tokens, for penalties)."""
    penalized = seq.params.penalized
    return [seq] + [SampleRow(seq.params, seq.seq_index, seq.num_generated + j,
                              seq.token_ids + list(draft[:j]) if penalized else seq.token_ids, seq.num_prompt_tokens)
                    for j in range(1, len(draft) + 1)]


def accepted_run(drawn: list, draft) -> int:
    """How many of a draft run's drawn tokens stand: while position j drew draft[j] the next
    position's logits are valid; the run ends with the first draw that differs (or an exception)."""
    n = 0
    while n < len(draft) and drawn[n].__class__ is int and drawn[n] == draft[n]:
        n += 1
    return n + 1
