"""Replay a token trace through the real Scheduler and HybridCacheManager with no model.

Each step does what the engine does around the forward pass: schedule, commit every chunk,
checkpoint where the chunk was cut for one, and for a chunk that completes its sequence append
the next token of the request's scripted output; a request ends after its whole output. KV and
state tensors are never read, so hit rates, checkpoint use and utilization are exact while a
step costs only the bookkeeping.

    result = replay(manager, trace, max_num_seqs=8)
    result.hit_rate, result.peak_checkpoints, result.mean_utilization
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.contiguous import pool_utilization
from hybridkv.request import Request as Seq
from hybridkv.sampling_params import SamplingParams
from hybridkv.state_pool import CHECKPOINT
from hybridkv.scheduler.preemption import PreemptionPolicy
from hybridkv.scheduler.scheduler import Scheduler

from traces import TraceRequest


@dataclass
class ReplayResult:
    """Per trace: prompt tokens, prefix-hit tokens (first admission of each request), the hits
    themselves, steps, prefill chunks, peak checkpoint slots, running requests and utilization per
    step."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    hits: list[tuple[int, int]] = field(default_factory=list)   # (prompt length, hit length)
    steps: int = 0
    peak_checkpoints: int = 0
    running: list[int] = field(default_factory=list)
    held_tokens: int = 0        # summed over steps
    reserved_tokens: int = 0    # summed over steps
    preemptions: int = 0
    prefill_chunks: int = 0     # chunks that compute prompt tokens (a checkpoint cut adds one)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_utilization(self) -> float:
        return self.held_tokens / self.reserved_tokens if self.reserved_tokens else 0.0

    @property
    def mean_running(self) -> float:
        return sum(self.running) / len(self.running) if self.running else 0.0


def replay(mgr: HybridCacheManager, trace: Sequence[TraceRequest], max_num_seqs: int = 8,
           max_active: Optional[int] = None, max_num_batched_tokens: int = 16384,
           max_steps: int = 1_000_000,
           on_step: Optional[Callable[[HybridCacheManager], None]] = None) -> ReplayResult:
    """Run `trace` to completion. At most `max_num_seqs` requests run at once and `max_active`
    sessions (default max_num_seqs; a lone request is a session of one) are open: a new one
    starts, in trace order, when an open one ends, so later sessions arrive while earlier ones
    run. A session's next turn is queued when its previous turn ends. Raises RuntimeError if the
    pools deadlock."""
    policy = PreemptionPolicy("recompute", mgr.specs, mgr.block_size, None, mgr.prefix_cache.enabled)
    sched = Scheduler(mgr, policy, max_num_batched_tokens, max_num_seqs)
    sessions: dict[Optional[str], deque] = {}
    order: list[TraceRequest] = []
    for t in trace:  # the first turn of each session (and every lone request) queues in trace order
        if t.session is None:
            order.append(t)
        elif t.session not in sessions:
            sessions[t.session] = deque()
            order.append(t)
        else:
            sessions[t.session].append(t)
    script: dict[str, TraceRequest] = {}
    res = ReplayResult()
    arrival = 0

    def submit(t: TraceRequest) -> None:
        nonlocal arrival
        arrival += 1
        req = Seq(t.request_id, list(t.prompt), SamplingParams(max_tokens=len(t.output)),
                      cache_salt=t.cache_salt, arrival=float(arrival))
        script[t.request_id] = t
        sched.add(req)

    pending = deque(order)
    for _ in range(min(len(pending), max_active or max_num_seqs)):
        submit(pending.popleft())
    admitted: set[str] = set()
    while sched.has_unfinished():
        if res.steps >= max_steps:
            raise RuntimeError(f"replay did not finish in {max_steps} steps; stats: {mgr.stats()}")
        out = sched.schedule()
        res.preemptions += len(out.preempted)
        chunks = out.all_chunks()  # a decode batch as its chunks
        if not chunks:
            if out.preempted:
                continue
            raise RuntimeError(f"no request fits the pools; stats: {mgr.stats()}")
        res.steps += 1
        for c in chunks:
            req, rid = c.seq, c.seq.request_id
            if rid not in admitted:  # first admission: this is the request's prefix hit
                admitted.add(rid)
                res.prompt_tokens += len(req.prompt_token_ids)
                res.hit_tokens += req.num_cached_tokens
                res.hits.append((len(req.prompt_token_ids), req.num_cached_tokens))
            res.prefill_chunks += c.start < len(req.prompt_token_ids)
            mgr.commit(rid, c.num_tokens)
            if c.checkpoint:
                mgr.prefix_cache.checkpoint(rid)
        held, reserved = pool_utilization(mgr)
        res.held_tokens += held
        res.reserved_tokens += reserved
        res.running.append(len(sched.running))
        if on_step is not None:
            on_step(mgr)
        for c in chunks:
            req = c.seq
            if c.start + c.num_tokens < req.num_tokens:
                continue  # prefill not finished: nothing sampled yet
            t = script[req.request_id]
            req.append_token(t.output[req.num_output_tokens])  # the manager reads the same list
            if req.num_output_tokens == len(t.output):
                sched.finish(req, "length")
                queue = sessions.get(t.session)
                if queue:
                    submit(queue.popleft())
                elif pending:  # the session is over: the next one arrives
                    submit(pending.popleft())
        if mgr.recurrent is not None:  # the slot count alone (stats() also scans every free KV block)
            res.peak_checkpoints = max(res.peak_checkpoints, mgr.recurrent.states.count(CHECKPOINT))
    return res
