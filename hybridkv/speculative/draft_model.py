"""Draft-model drafting: a smaller checkpoint with the target's vocabulary proposes k greedy tokens,
run inside the target's step with memory of its own (docs/design.md, "Speculative decoding").

The drafter owns the draft model, its own HybridCacheManager (KV blocks, state slots and prefix
cache sized from 1/DRAFT_BUDGET_SHARE of the budget) and a ModelRunner over them; it is the only
writer of that manager, as the scheduler is of the target's. For each target request that asks
for a proposal it keeps a draft request D whose token list mirrors the target's. Between steps D
has committed exactly the target's tokens (never a speculative one). `propose_many` serves all
the asks of a step together:
1. catch-up: D takes the target's tokens appended since its last proposal (on first sight it is
   admitted through a prefix match in the draft's own cache) and computes them in batched
   forwards, committed, cut where a state checkpoint is due as the scheduler cuts prefills; the
   forward that computes its last token samples d_1;
2. rounds j = 2..k: d_1 .. d_{k-1} are one draft run of D (`mgr.drafts.allocate(D, k - 2)`: KV
   slots and a state slot chain [live, s_1 .. s_{k-1}]); round j computes d_{j-1} as a one-token
   chunk that starts from chain[j - 2] and leaves its state in chain[j - 1] (the live slot is
   never written), all drafting requests in one forward, and samples d_j;
3. `mgr.drafts.commit(D, 0)` keeps none of the run: its KV past the real tokens and its draft
   slots go back.
So a step costs the draft k forwards (a catch-up cut at a checkpoint one more), and the draft
computes each real token once, plus k - 1 speculative positions a proposal.
Memory: the draft never preempts anything of the target. When its pools cannot admit or
allocate, the least recently asked D's outside this step are freed (their state stays in the
draft's prefix cache under its checkpoint policy); if that is not enough the request gets no
proposal this step (or d_1 alone when only the rounds do not fit). `forget` frees D when the
target request ends (finished, aborted, migrated away); a preempted request keeps its D (its tokens
do not change), and a request imported from another engine builds a D here through this prefix
cache. An ask without a new token since the last proposal (the request was preempted by swap
between the proposal and its verification) gets that proposal again.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence, TypeVar

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import RequestTooLargeError
from hybridkv.models import load_model
from hybridkv.request import Request
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.model_runner import ModelRunner, RunnerOutput
from hybridkv.scheduler.request_group import RequestGroup
from hybridkv.scheduler.step_plan import ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)

DRAFT_CHECKPOINT_POLICY = "prompt_end"  # the draft's: its prompt's state, and one rolling state in the output
DRAFT_BUDGET_SHARE = 8  # the draft's pools take 1/8 of the memory budget, the target's the rest
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)

T = TypeVar("T")


@dataclass
class DraftRun:
    """One request's rounds this step: D, its k, the run's KV slots and slot chain, the proposal."""

    d: Request
    k: int
    kv: list[int]
    chain: list[int]
    proposal: list[int]


class DraftModelDrafter:
    """Proposals of `model` (the draft checkpoint) over `manager` (its own pools); see the module
    doc. vocab_size: the target's (the draft's must equal it); max_num_batched_tokens: the most
    tokens of one catch-up forward."""

    def __init__(self, model, manager: HybridCacheManager, vocab_size: int, max_num_batched_tokens: int):
        check_vocabulary(model, vocab_size)
        self.model = model
        self.mgr = manager
        self.runner = ModelRunner(model, manager)
        self.max_tokens = max_num_batched_tokens
        self._reqs: OrderedDict[Hashable, Request] = OrderedDict()  # D by target request id, least recently asked first
        self._groups: dict[Hashable, RequestGroup] = {}  # the runner reads each D's group (no forks, no prompt logprobs)
        self._last: dict[Hashable, list[int]] = {}  # each D's last proposal
        self.counters = {"draft_forwards": 0, "draft_real_tokens": 0, "draft_speculative_tokens": 0,
                         "draft_evictions": 0}

    @classmethod
    def load(cls, path: str, vocab_size: int, budget_bytes: int, *, device, dtype, block_size: int,
             max_num_seqs: int, max_num_batched_tokens: int, draft_slots: int) -> "DraftModelDrafter":
        """The draft checkpoint at `path` on `device` in `dtype`, its pools planned from budget_bytes
        (prefix caching on, policy DRAFT_CHECKPOINT_POLICY, draft_slots state slots kept for its rounds)."""
        model = load_model(path, device=device, dtype=dtype)
        check_vocabulary(model, vocab_size, path)
        params = sum(p.numel() for p in model.parameters())
        mgr = HybridCacheManager.from_budget(
            model.cache_specs(), budget_bytes, block_size, max_num_seqs, device=model.device,
            checkpoint_policy=DRAFT_CHECKPOINT_POLICY, fingerprint=model.fingerprint, flops_per_token=2.0 * params,
            max_num_batched_tokens=max_num_batched_tokens, draft_slots=draft_slots)
        return cls(model, mgr, vocab_size, max_num_batched_tokens)

    # ---- the step ---------------------------------------------------------------------------
    def propose_many(self, asks: Sequence[tuple[Hashable, Sequence[int], int]]) -> list[list[int]]:
        """asks: (target request id, its tokens, k) -> up to k greedy draft tokens for each ([]:
        none this step), computed for all asks together (see the module doc)."""
        out: list[list[int]] = [[] for _ in asks]
        step = {rid for rid, _, _ in asks}
        ready = []
        limit = self.model.max_model_len
        for i, (rid, tokens, k) in enumerate(asks):
            k = min(k, limit - len(tokens)) if limit else k
            d = self._mirror(rid, tokens) if k > 0 else None
            if d is None:
                continue
            if d.num_computed_tokens == len(d.token_ids) and rid in self.mgr.requests:  # nothing new
                out[i] = self._last.get(rid, [])[:k]
                continue
            ready.append((i, d, k))
        runs: dict[int, DraftRun] = {}
        for i, (d, k, first) in self._catch_up(ready, step).items():
            out[i] = [first]
            if k > 1:
                d.token_ids.append(first)
                got = self._with_room(lambda: self.mgr.drafts.allocate(d.request_id, k - 2), step)
                if got is None:  # no room for the rounds: d_1 alone
                    d.token_ids.pop()
                else:
                    runs[i] = DraftRun(d, k, *got, out[i])
        self._rounds(list(runs.values()))
        for i, (rid, _, _) in enumerate(asks):
            if out[i] and rid in self._reqs:
                self._last[rid] = out[i]
        return out

    def propose(self, request_id: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_many([(request_id, tokens, k)])[0]

    def forget(self, request_id: Hashable) -> None:
        """The target request ended: its D's memory goes (what it computed stays findable in the
        draft's prefix cache)."""
        self._free(request_id)

    # ---- its parts ---------------------------------------------------------------------------
    def _mirror(self, rid: Hashable, tokens: Sequence[int]) -> Optional[Request]:
        """rid's D with the target's tokens appended (a new D on first sight, or when the tokens are
        not the ones D mirrors); the most recently asked now."""
        d = self._reqs.get(rid)
        if d is not None:
            n = len(d.token_ids)
            if len(tokens) >= n and tokens[n - 1] == d.token_ids[-1]:
                d.token_ids.extend(tokens[n:])
                self._reqs.move_to_end(rid)
                return d
            self._free(rid)
        d = self._reqs[rid] = Request(rid, tokens, GREEDY, max_tokens=0)
        self._groups[rid] = RequestGroup(str(rid), None, GREEDY, [d], key=rid)
        return d

    def _catch_up(self, ready: list, step: set) -> dict[int, tuple[Request, int, int]]:
        """Compute each ready D's uncomputed tokens, committed, in batched forwards of at most
        max_tokens tokens; {ask index: (D, k, d_1)} of those whose last token was computed."""
        first, pending = {}, ready
        mgr = self.mgr
        while pending:
            budget, chunks, owners, later = self.max_tokens, [], [], []
            for item in pending:
                chunk = self._next_chunk(item[1], budget, step) if budget else None
                if chunk is None:
                    if budget == 0:
                        later.append(item)
                    continue
                chunks.append(chunk)
                owners.append(item)
                budget -= chunk.num_tokens
            if not chunks:
                break
            result = self._forward(chunks)
            with mgr.prefix_cache.batched_checkpoints():
                for c, (i, d, k), tok in zip(chunks, owners, self._tokens(result, chunks)):
                    rid = d.request_id
                    try:
                        if tok is None:
                            raise RuntimeError(f"the draft's forward failed for {rid!r}: {result.error or 'not finite'}")
                        mgr.commit(rid, c.num_tokens)
                        if c.checkpoint:
                            mgr.prefix_cache.checkpoint(rid)
                    except Exception as e:
                        log.warning("draft request %r dropped: %s", rid, e)
                        self._free(rid, discard=True)
                        continue
                    self.counters["draft_real_tokens"] += c.num_tokens
                    if d.num_computed_tokens < len(d.token_ids):
                        later.append((i, d, k))
                    else:
                        first[i] = (d, k, tok)
            pending = later
        return first

    def _next_chunk(self, d: Request, budget: int, step: set) -> Optional[ScheduledChunk]:
        """D's next chunk of at most `budget` tokens (admitting D first when the manager does not
        hold it), cut where a checkpoint is due; None when the pools have no room (D unchanged)."""
        mgr, rid = self.mgr, d.request_id
        try:
            if rid not in mgr.requests and self._with_room(lambda: mgr.admit(d, num_new_tokens=budget), step) is None:
                return None
            start = d.num_computed_tokens
            n = min(len(d.token_ids) - start, budget)
            due = mgr.prefix_cache.checkpoint_due(rid, start, start + n)
            if due is not None:
                n = due - start
            slots = self._with_room(lambda: mgr.allocate(rid, n), step)
        except RequestTooLargeError:  # the draft's pools can never hold it: no proposals for it
            self._free(rid)
            return None
        return None if slots is None else ScheduledChunk(d, start, n, slots, due is not None)

    def _rounds(self, runs: list[DraftRun]) -> None:
        """Rounds 2..k of every run (one forward each over the runs still going), then each run
        dropped whole (`commit(D, 0)`): its proposal extended by one token a round."""
        live = runs
        for j in range(2, max((r.k for r in runs), default=1) + 1):
            live = [r for r in live if r.k >= j]
            if not live:
                break
            chunks = []
            for r in live:  # d_{j-1} at position (last real) + j - 1, from chain[j - 2] into chain[j - 1]
                start = r.d.num_computed_tokens + j - 2
                chunks.append(ScheduledChunk(r.d, start, 1, [r.kv[j - 2]], verify_slots=r.chain[j - 2:j]))
            result = self._forward(chunks)
            self.counters["draft_speculative_tokens"] += len(chunks)
            going = []
            for r, tok in zip(live, self._tokens(result, chunks)):
                if tok is None:
                    continue  # its proposal ends here
                r.proposal.append(tok)
                if j < r.k:
                    r.d.token_ids.append(tok)
                    going.append(r)
            live = going
        for r in runs:
            rid = r.d.request_id
            try:
                self.mgr.drafts.commit(rid, 0)
            except Exception as e:
                log.warning("draft request %r dropped: %s", rid, e)
                self._free(rid, discard=True)
            finally:
                del r.d.token_ids[r.d.num_computed_tokens:]

    def _forward(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        self.counters["draft_forwards"] += 1
        return self.runner.execute(SchedulerOutput(chunks=chunks), self._groups)

    @staticmethod
    def _tokens(result: RunnerOutput, chunks: list[ScheduledChunk]) -> list:
        """Per chunk: its sampled token, -1 for a finite chunk short of its sequence's end, None
        when its forward failed or its logits are not finite."""
        if result.error is not None:
            return [None] * len(chunks)
        out = []
        for i in range(len(chunks)):
            tok = result.tokens[i][0] if i in result.tokens else -1
            out.append(tok if result.finite[i] and tok.__class__ is int else None)
        return out

    def _with_room(self, attempt: Callable[[], Optional[T]], step: set) -> Optional[T]:
        """attempt() until it gives something other than None, freeing the least recently asked D
        outside this step's asks between tries; None when none is left to free."""
        while (got := attempt()) is None:
            victim = next((rid for rid in self._reqs if rid not in step and rid in self.mgr.requests), None)
            if victim is None:
                return None
            self._free(victim)
            self.counters["draft_evictions"] += 1
        return got

    def _free(self, rid: Hashable, discard: bool = False) -> None:
        self._reqs.pop(rid, None)
        self._groups.pop(rid, None)
        self._last.pop(rid, None)
        if rid in self.mgr.requests:
            self.mgr.finish(rid, discard=discard)


def check_vocabulary(model, vocab_size: int, path: str = "") -> None:
    """ValueError unless the draft `model` has the target's vocabulary size."""
    if model.vocab_size != vocab_size:
        raise ValueError(f"draft model {path or 'given'!r} has a vocabulary of {model.vocab_size} tokens; "
                         f"the target's has {vocab_size}: a draft must share the target's tokenizer")
