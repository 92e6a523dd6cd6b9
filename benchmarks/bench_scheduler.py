"""Scheduler step cost with a deep waiting queue: 20,000 waiting requests, no model.

    python benchmarks/bench_scheduler.py                  # 20,000 waiting vs 200 waiting, 5 repeats
    python benchmarks/bench_scheduler.py --waiting 50000 --repeats 7

The real Scheduler and HybridCacheManager run as in benchmarks/replay.py, with no forward pass:
a step schedules, commits every chunk, checkpoints where a chunk was cut for one, appends a
scripted token to each sequence whose chunk reached its end, and finishes those at their length
(freeing a seat for the head of the waiting queue); new requests arrive between steps to keep
the queue at its depth. `max_num_seqs` run at once and the rest wait, so a step schedules the
same work whatever the queue depth: its cost should not grow with it.
Timed: CPU time (`time.process_time`) of each step after a warm-up that admits and prefills the
first batch, one torch thread; per repeat the median step, then the median of the repeats and
their min-max. Goal: < 2 ms per step with 20,000 waiting.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time

import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.preemption import PreemptionPolicy
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.specs import AttentionSpec, RecurrentSpec

GOAL_MS = 2.0
# Tiny stand-in tensors: the scheduler and manager never read KV or state values.
SPECS = {0: AttentionSpec(1, 4, torch.float16), 1: RecurrentSpec((2, 3), (2, 2), torch.float16)}
BLOCK_SIZE = 16


class Arrivals:
    """New requests of 16-128 random prompt tokens and 4-32 output tokens, in arrival order."""

    def __init__(self, seed: int = 0):
        self.rng, self.count = random.Random(seed), 0

    def next(self) -> Request:
        rng, i = self.rng, self.count
        self.count += 1
        prompt = [rng.randrange(4, 32000) for _ in range(rng.randint(16, 128))]
        return Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(4, 32)), arrival=float(i))


def build(num_waiting: int, max_num_seqs: int, max_batched_tokens: int,
          seed: int = 0) -> tuple[Scheduler, Arrivals]:
    """A scheduler over a fresh manager with `num_waiting` queued requests, and the arrivals that
    made them (for more); the pools are sized so that seats, not memory, bound the batch."""
    blocks = 4 * max_num_seqs * (128 + 32) // BLOCK_SIZE
    mgr = HybridCacheManager(SPECS, BLOCK_SIZE, blocks, 1 + max_num_seqs + 16, fingerprint="bench_scheduler")
    policy = PreemptionPolicy("recompute", SPECS, BLOCK_SIZE, None, True)
    sched = Scheduler(mgr, policy, max_batched_tokens, max_num_seqs)
    arrivals = Arrivals(seed)
    for _ in range(num_waiting):
        sched.add(arrivals.next())
    return sched, arrivals


def step(sched: Scheduler) -> int:
    """One engine step without the model; returns the number of scheduled chunks."""
    out = sched.schedule()
    mgr = sched.mgr
    chunks = out.all_chunks()  # a decode batch as its chunks
    for c in chunks:
        mgr.commit(c.seq.request_id, c.num_tokens)
        if c.checkpoint:
            mgr.prefix_cache.checkpoint(c.seq.request_id)
    for c in chunks:
        seq = c.seq
        if c.start + c.num_tokens < seq.num_tokens:
            continue  # a prefill chunk short of the end: nothing sampled yet
        seq.append_token(seq.num_tokens % 997 + 4)  # the manager reads the same list
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return len(chunks)


def step_times(num_waiting: int, steps: int, warmup: int, max_num_seqs: int = 64,
               max_batched_tokens: int = 2048, seed: int = 0) -> list[float]:
    """CPU seconds of each of `steps` steps taken after `warmup` untimed ones; between steps
    (untimed) new requests arrive to keep `num_waiting` waiting, so every step sees that depth."""
    sched, arrivals = build(num_waiting + max_num_seqs, max_num_seqs, max_batched_tokens, seed)
    times = []
    for i in range(warmup + steps):
        t0 = time.process_time()
        step(sched)
        if i >= warmup:
            times.append(time.process_time() - t0)
        while len(sched.waiting) < num_waiting:
            sched.add(arrivals.next())
    return times


def measure(num_waiting: int, repeats: int, steps: int, warmup: int) -> list[float]:
    """The median step (seconds) of each repeat, a fresh scheduler and manager per repeat."""
    return [statistics.median(step_times(num_waiting, steps, warmup, seed=r)) for r in range(repeats)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waiting", type=int, default=20_000)
    ap.add_argument("--small", type=int, default=200, help="the shallow queue to compare with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}, "
          f"torch {torch.__version__}, 1 torch thread; 64 running, 2048 tokens per step")
    ms = {}
    for n in (args.small, args.waiting):
        med = [1e3 * t for t in measure(n, args.repeats, args.steps, args.warmup)]
        ms[n] = statistics.median(med)
        print(f"  {n:>7,} waiting: {ms[n]:.3f} ms per step (median of {args.repeats} repeats of "
              f"{args.steps} steps; min-max {min(med):.3f}-{max(med):.3f} ms)")
    print(f"  goal < {GOAL_MS} ms with {args.waiting:,} waiting: {ms[args.waiting] / GOAL_MS:.2f}x the goal "
          f"({'met' if ms[args.waiting] < GOAL_MS else 'NOT met'}); {args.waiting:,} vs {args.small:,} "
          f"waiting: {ms[args.waiting] / ms[args.small]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
