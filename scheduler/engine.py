"""The engine step: schedule, build the packed batch, run the model, sample, advance the manager.

Request-level API for a server: `add_request`, `step`, `abort`, `export_request` /
`import_request` (migration), `stats`. A request id names a `SequenceGroup`: a prompt and its n
sequences. Each `Sequence` owns its token list; the manager reads sampled tokens from it.
"""
from __future__ import annotations

import numbers
import time
from typing import Optional

import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.models.forward_batch import ForwardBatch, ModelCaches
from hybridkv.outputs import CompletionOutput, RequestOutput
from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot

from . import migration
from .sampler import SampleRow, Sampler
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, SequenceGroup
from .stopping import check_stop


class Engine:
    def __init__(self, model, manager: HybridCacheManager, scheduler: Scheduler, seed: int = 0):
        self.model = model
        self.mgr = manager
        self.scheduler = scheduler
        self.sampler = Sampler(seed)
        self.device = model.device
        self.tokenizer = getattr(model, "tokenizer", None)
        self.eos_ids = set(model.eos_token_ids)
        self.max_model_len = model.max_model_len
        self.caches = ModelCaches(kv=manager.kv_caches, conv=manager.conv_states,
                                  state=manager.ssm_states, block_size=manager.block_size)
        self.groups: dict[str, SequenceGroup] = {}
        self.counters = {"steps": 0, "generated_tokens": 0, "processed_tokens": 0, "model_seconds": 0.0,
                         "swaps_out": 0, "migrations_out": 0, "migrations_in": 0, "forks": 0,
                         "aborted": 0}

    # ---- requests --------------------------------------------------------------------------
    def validate(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError (TypeError for a wrong type) naming the value and the limit; nothing in
        the engine changes."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise TypeError(f"priority must be an integer (lower runs first), got {priority!r}")
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; this model's max_model_len is "
                             f"{self.max_model_len} (and one token must be left to generate)")
        self.mgr.check_fits(len(token_ids), min(params.max_tokens, self.max_model_len - len(token_ids)))

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    prompt: Optional[str] = None, priority: int = 0,
                    cache_salt: Optional[str] = None) -> None:
        """Queue a prompt's token ids as request `request_id` (its n sequences fork after prefill)."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = [int(t) for t in token_ids]
        self.validate(token_ids, params, priority)
        seq = Sequence(request_id, token_ids, params, priority=int(priority), cache_salt=cache_salt)
        self.groups[request_id] = SequenceGroup(request_id, prompt, params, [seq])
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks and slots."""
        g = self.groups.pop(request_id, None)
        if g is None:
            return
        for s in g.seqs:
            self.scheduler.finish(s, "abort")
        self.counters["aborted"] += 1

    def export_request(self, request_id: str) -> RequestSnapshot:
        """Freeze request `request_id` (n == 1) into a snapshot and release it from this engine."""
        g = self.groups.get(request_id)
        if g is None:
            raise KeyError(f"unknown request id {request_id!r}")
        snap = migration.freeze(g, self.mgr)
        del self.groups[request_id]
        self.scheduler.finish(g.seqs[0], "migrated")
        self.counters["migrations_out"] += 1
        return snap

    def import_request(self, snap: RequestSnapshot) -> None:
        """Continue a migrated request here. Raises SnapshotMismatchError for another model, and
        RuntimeError when the pools cannot take its KV and state now (then nothing changed)."""
        rid = str(snap.req_id)
        if rid in self.groups:
            raise ValueError(f"request id {rid!r} is already in use on this engine")
        g, holds_memory = migration.thaw(snap, self.mgr)
        if holds_memory:
            self.scheduler.add_running(g.seqs[0])
        else:  # moved as tokens: recomputed here
            self.scheduler.add(g.seqs[0])
        self.groups[rid] = g
        self.counters["migrations_in"] += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Pools (blocks, slots), prefix hits and why requests missed, preemptions, tokens/s."""
        m = self.mgr.stats()
        c = self.counters
        secs = c["model_seconds"]
        return {
            "kv_blocks_used": m.kv_blocks_used, "kv_blocks_cached": m.kv_blocks_cached,
            "kv_blocks_total": m.kv_blocks_total, "state_slots_live": m.slots_live,
            "state_slots_checkpoint": m.slots_checkpoint, "state_slots_total": m.slots_total,
            "prefix_hit_tokens": m.prefix_hit_tokens, "prefix_query_tokens": m.prefix_query_tokens,
            "prefix_hit_rate": m.prefix_hit_rate, "prefix_misses": dict(m.prefix_misses),
            "preemptions": dict(m.preemptions), "burst_waits": m.burst_waits, "swaps": c["swaps_out"],
            "migrations": {"out": c["migrations_out"], "in": c["migrations_in"]},
            "forks": c["forks"], "aborted": c["aborted"], "fragmentation": m.fragmentation,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped), "steps": c["steps"],
            "generated_tokens": c["generated_tokens"],
            "tokens_per_second": c["processed_tokens"] / secs if secs else 0.0,  # prompt + decode
            "generated_tokens_per_second": c["generated_tokens"] / secs if secs else 0.0,
        }

    # ---- the step --------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one batch; returns the outputs of the requests that advanced (only those that
        finished, with `finished_only`: what generate() needs, without per-step copies)."""
        plan = self.scheduler.schedule()
        self.counters["swaps_out"] += sum(1 for _, m in plan.preempted if m == "swap")
        if not plan.chunks:
            if self.scheduler.has_unfinished() and not plan.preempted:
                raise RuntimeError("the scheduler made no progress: no request fits the pools; "
                                   f"stats: {self.mgr.stats()}")
            return []
        t0 = time.perf_counter()
        with torch.inference_mode():  # no autograd graph (it would also chain the pools across steps)
            logits = self.model(self._batch(plan.chunks), self.caches)
        self.counters["model_seconds"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["processed_tokens"] += plan.num_tokens
        touched: dict[str, SequenceGroup] = {}
        rows, row_reqs = [], []
        for i, c in enumerate(plan.chunks):
            rid = c.seq.request_id
            self.mgr.commit(rid, c.num_tokens)
            if c.checkpoint:
                self.mgr.checkpoint(rid)
            if c.start + c.num_tokens < c.seq.num_tokens:
                continue  # a prefill chunk short of the end: nothing to sample yet
            for seq in self._fork_children(c.seq):
                rows.append(i)
                row_reqs.append(seq)
        if rows:
            tokens, logprobs = self.sampler(
                logits[rows], [SampleRow(s.params, s.seq_index, s.num_output_tokens) for s in row_reqs])
            for seq, tok, lp in zip(row_reqs, tokens, logprobs):
                self._append(seq, tok, lp)
                touched[seq.group_id] = self.groups[seq.group_id]
        if finished_only:
            return [self._output(g) for g in touched.values() if g.finished]
        return [self._output(g) for g in touched.values()]

    def _batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start:c.start + c.num_tokens])
            pos.extend(range(c.start, c.start + c.num_tokens))
            slots.extend(c.slot_mapping)
            qsl.append(qsl[-1] + c.num_tokens)
            seq_lens.append(c.start + c.num_tokens)
        rids = [c.seq.request_id for c in chunks]
        dev, i32 = self.device, torch.int32
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=i32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=i32, device=dev),
            block_table=self.mgr.block_table(rids).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots=torch.tensor([self.mgr.live_slot(r) for r in rids], dtype=i32, device=dev),
            has_initial_state=torch.tensor([c.start > 0 for c in chunks], device=dev),
            query_lens_cpu=[c.num_tokens for c in chunks], seq_lens_cpu=seq_lens)

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        """The sequences that sample from this row: the parent, plus its n-1 forks when its
        prompt just finished (they share its blocks and start from copies of its state)."""
        out = [parent]
        g = self.groups[parent.group_id]
        if parent.seq_index != 0:
            return out
        while g.forks_pending:
            j = len(g.seqs)
            child = parent.fork(f"{g.request_id}#{j}", j)
            g.seqs.append(child)
            if self.mgr.fork(parent.request_id, child.request_id, token_ids=child.token_ids):
                self.scheduler.add_running(child)
                self.counters["forks"] += 1
                out.append(child)
            else:  # no slot to copy into now: the child prefills on its own (a prefix hit at best)
                self.scheduler.add(child)
        return out

    def _append(self, seq: Sequence, token: int, logprobs) -> None:
        seq.append_token(token, logprobs)
        self.counters["generated_tokens"] += 1
        reason = check_stop(seq, self.eos_ids, self.max_model_len, self.tokenizer)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, g: SequenceGroup) -> RequestOutput:
        outs = [CompletionOutput(s.seq_index, s.output_token_ids, s.finish_reason,
                                 list(s.output_logprobs) if s.params.logprobs is not None else None,
                                 self.tokenizer, tuple(s.params.stop))
                for s in g.seqs]
        done = g.finished
        if done:
            self.groups.pop(g.request_id, None)
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, done,
                             g.seqs[0].num_cached_tokens)
