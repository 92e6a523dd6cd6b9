"""The scheduler's side of speculative decoding: which running decodes verify a draft this step,
how many tokens each drafts, and, after the forward pass, what each run keeps (`commit_runs`)
(hybridkv/speculative/ has the drafters; docs/design.md, "Speculative decoding", the semantics).

A running request with one token left to compute asks the drafter for up to k tokens. With a
proposal it becomes a chunk of k + 1 tokens (its last token, then the draft) instead of a row of
the decode batch, when the step's token budget and the pools can take it without preempting or
evicting anything (`HybridCacheManager.drafts`, hybridkv/draft_runs.py); otherwise it decodes as usual.
k adapts per request: it starts at num_speculative_tokens, grows by one after a run that took
every drafted token, and falls to one more than the tokens taken after one that did not; a run
that took none makes the request skip drafting for 1, 2, 4, ... 64 steps (drafts that never
match then cost one verification every 64 steps).
Whether it pays at all is measured (`StepCosts`, with `off_when_slower`): per batch size (1, 2-3,
4-7, ...), the generated tokens per second of decode-only steps with draft runs and without; where
the drafts' rate is the lower, the step drafts nothing, but for a probe every 32 steps (on a CPU,
verifying k + 1 positions costs nearly k + 1 times a decode once the weights' arithmetic, not
their reading, bounds a step: BENCHMARKS.md, "Speculative decoding").
Counters (the engine's stats and /metrics): verification runs, drafted and accepted tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional

from hybridkv.request import Request
from hybridkv.speculative.config import SpeculativeConfig
from hybridkv.speculative.ngram import NgramDrafter

from .model_runner import NONFINITE, RunnerOutput
from .step_plan import DecodeBatch, ScheduledChunk, SchedulerOutput

MAX_SKIP = 64
PROBE_EVERY = 32  # steps of a batch size between probes of the way the cost model does not choose
EMA = 0.25  # weight of a new step in the measured rates


class StepCosts:
    """Measured generated tokens per second of decode-only steps, with draft runs and without,
    per batch-size bucket (n.bit_length(): 1, 2-3, 4-7, ...)."""

    def __init__(self):
        self.rate: dict[tuple[int, bool], float] = {}
        self.steps: dict[int, int] = {}

    def choose(self, bucket: int) -> bool:
        """Whether a step with this many decodes drafts: first measure both ways; then the faster,
        and the other every PROBE_EVERY steps."""
        n = self.steps[bucket] = self.steps.get(bucket, 0) + 1
        on, off = self.rate.get((bucket, True)), self.rate.get((bucket, False))
        if on is None or off is None:
            return on is None
        return (on >= off) != (n % PROBE_EVERY == 0)

    def record(self, bucket: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        key, r = (bucket, drafted), tokens / seconds
        old = self.rate.get(key)
        self.rate[key] = r if old is None else old + EMA * (r - old)


@dataclass
class DraftPace:
    """One request's k and back-off."""

    k: int
    skip: int = 0  # steps left without drafting
    misses: int = 0  # runs in a row that took no draft token


class Speculation:
    """Drafts for a scheduler's decodes (see the module doc); `block_size` caps k (a run crosses
    at most one block boundary, where a state checkpoint may be due)."""

    def __init__(self, config: SpeculativeConfig, block_size: int, drafter=None):
        """drafter: what proposes (None: the n-gram drafter; LLM passes a DraftModelDrafter for
        method 'draft_model', an MtpDrafter for 'mtp'); any object with `propose_many([(request id, token ids, k)]) ->
        [draft]` (a draft may be shorter than k, or empty) and `forget(request id)`."""
        self.config = config
        self.k_max = self.max_draft(config, block_size)
        self.drafter = drafter if drafter is not None else NgramDrafter(config.prompt_lookup_min,
                                                                         config.prompt_lookup_max)
        self.costs = StepCosts() if config.off_when_slower else None
        self._step: Optional[tuple[int, bool]] = None  # this step's (bucket, drafted), for the costs
        self._pace: dict[Hashable, DraftPace] = {}
        self.counters = {"spec_verify_runs": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}

    @staticmethod
    def max_draft(config: SpeculativeConfig, block_size: int) -> int:
        """The most tokens a request drafts: num_speculative_tokens, below block_size."""
        if block_size < 2:
            raise ValueError(f"speculative decoding needs block_size >= 2, got {block_size}")
        return min(config.num_speculative_tokens, block_size - 1)

    @staticmethod
    def draft_slots(config: Optional[SpeculativeConfig], block_size: int, max_num_seqs: int) -> int:
        """State slots the memory plan keeps for draft runs: k + 1 for each request that may
        verify a draft in one step (0 with speculation off)."""
        if config is None:
            return 0
        return (Speculation.max_draft(config, block_size) + 1) * min(max_num_seqs, config.max_speculating_seqs)

    def next_k(self, request_id: Hashable) -> int:
        """The most tokens the request drafts at its next step (1 while it skips drafting: an MTP
        head's first token costs nothing more, its chain would)."""
        pace = self._pace.get(request_id)
        return self.k_max if pace is None else 1 if pace.skip else pace.k

    def wanted(self, seq: Request, budget: int) -> int:
        """How many tokens seq drafts this step (0: none): its k, within the budget and what its
        max_tokens / max_model_len leave after the token the run always yields."""
        pace = self._pace.get(seq.request_id)
        if pace is None:
            pace = self._pace[seq.request_id] = DraftPace(self.k_max)
        if pace.skip:
            pace.skip -= 1
            return 0
        room = seq.num_prompt_tokens + seq.max_tokens - len(seq.token_ids) - 1
        return max(0, min(pace.k, budget, room))

    def take_drafts(self, mgr, out: SchedulerOutput, budget: int) -> int:
        """Turn rows of the step's decode batch that have a draft into draft chunks (appended to
        out.chunks) where the pools can take them; returns the token budget left."""
        batch, self._step = out.decodes, None
        if batch is None:
            return budget
        bucket = len(batch).bit_length()
        if self.costs is not None and not self.costs.choose(bucket):
            self._step = (bucket, False)
            return budget
        asks = [(i, seq, k) for i, seq in enumerate(batch.seqs) for k in [self.wanted(seq, budget)] if k]
        drafts = dict(zip((i for i, _, _ in asks), self.drafter.propose_many(
            [(seq.request_id, seq.token_ids, k) for _, seq, k in asks]))) if asks else {}
        keep, chunks = [], []
        for i, seq in enumerate(batch.seqs):
            draft = drafts.get(i, [])[:budget]
            got = mgr.drafts.allocate(seq.request_id, len(draft)) if draft else None
            if got is None:
                keep.append(i)
                continue
            kv, chain = got
            chunks.append(ScheduledChunk(seq, int(batch.positions[i]), len(draft) + 1, kv, draft=draft,
                                         verify_slots=chain))
            budget -= len(draft)
        if chunks:
            out.decodes = batch.without(keep)
            out.chunks[:0] = chunks  # before the prefills, as decodes
        self._step = (bucket, bool(chunks))
        return budget

    def commit_runs(self, mgr, chunks: list[ScheduledChunk], result: RunnerOutput,
                    fail: Callable[[Request, object], None],
                    append: Callable[[list[Request], list, list], None]) -> None:
        """After the forward pass, the chunks that verified a draft: each keeps the positions its
        accepted run computed (the token before the draft and the draft tokens accepted:
        `mgr.drafts.commit` with the accepted tokens in its list for the call), then appends the
        run, stopping where a stop rule says (a stop inside the run ends it there). A run whose
        logits are not finite, or whose commit raised, ends its request: fail(seq, error), its
        memory discarded. append(seqs, tokens, logprobs): the scheduler's token appending."""
        for i, c in enumerate(chunks):
            seq = c.seq
            if not c.draft or seq.finished:
                continue
            if not result.finite[i]:
                fail(seq, NONFINITE)
                continue
            run, lps = result.tokens[i], result.logprobs[i]
            accepted, ids = len(run) - 1, seq.token_ids
            ids.extend(c.draft[:accepted])
            try:
                mgr.drafts.commit(seq.request_id, accepted + 1)
            except Exception as e:
                fail(seq, e)
                continue
            finally:
                del ids[len(ids) - accepted:]
            self.observe(seq, len(c.draft), accepted)
            append([seq] * len(run), run, lps)

    def all_counters(self) -> dict:
        """The verification counters and the drafter's own (a draft model's: draft_forwards,
        draft_real_tokens, draft_speculative_tokens, draft_evictions; other drafters keep none)."""
        return {**self.counters, **getattr(self.drafter, "counters", {})}

    def step_done(self, out: SchedulerOutput, tokens: int, seconds: float) -> None:
        """The engine's step (`out`) ended: `tokens` generated in `seconds`. A decode-only step
        counts towards the costs of its batch size."""
        if self.costs is None or self._step is None or any(not c.draft for c in out.chunks):
            return
        self.costs.record(*self._step, tokens, seconds)

    def observe(self, seq: Request, drafted: int, accepted: int) -> None:
        """A verification run of `drafted` tokens took `accepted` of them."""
        c = self.counters
        c["spec_verify_runs"] += 1
        c["spec_draft_tokens"] += drafted
        c["spec_accepted_tokens"] += accepted
        pace = self._pace.get(seq.request_id)
        if pace is None:
            return
        if accepted == drafted:
            pace.k, pace.misses = min(self.k_max, pace.k + 1), 0
        elif accepted == 0:
            pace.misses += 1
            pace.k, pace.skip = 1, min(MAX_SKIP, 1 << (pace.misses - 1))
        else:
            pace.k, pace.misses = accepted + 1, 0

    def forget(self, request_id: Hashable) -> None:
        self._pace.pop(request_id, None)
        self.drafter.forget(request_id)
