"""A steady decode batch's sampling and token appending: the per-row path against the batch path.

    python benchmarks/bench_token_append.py                  # 256 rows, vocabulary 512, 200 steps
    python benchmarks/bench_token_append.py --rows 32 --repeats 9

Rows are greedy without logprobs (EOS not ignored: the EOS ids are looked up every step, but their logits are
kept low so no row stops and the batch stays the same), max_tokens large, random logits. Per step:
  before:  what `Sampler.__call__` did before 474668c (the all-greedy check over the rows' params, then
           torch's `argmax(dim=-1).tolist()`) and `TokenAppender.__call__` (a loop over rows with a
           StopRule test each);
  per-row: `Sampler.__call__` now (the all-greedy check, `greedy`: numpy's argmax on the CPU) and
           `TokenAppender.__call__`;
  batch:   `Sampler.greedy` and `TokenAppender.append_batch` with `Sampler.all_greedy` and the
           BatchStops made once per batch (that one-off cost printed apart, the rows' StopRules
           already made, as the engine's are by their first token), lengths kept as an array;
           `BatchStops.keep` (the batch less a row that stopped) printed apart too.
CPU time (`time.process_time`, 1 torch thread), the two paths alternating in one process, each
repeat on fresh sequences; per path the median of the repeats' ms per step, with min-max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from hybridkv.request import Request, RequestStatus
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.sampler import Sampler
from hybridkv.scheduler.token_append import TokenAppender

EOS = (2, 3)


def batch(rows: int, vocab: int, rng: np.random.Generator) -> list[Request]:
    params = SamplingParams(max_tokens=100_000, temperature=0.0)
    seqs = [Request(f"r{i}", rng.integers(4, vocab, rng.integers(16, 200)).tolist(), params) for i in range(rows)]
    for s in seqs:
        s.status = RequestStatus.RUNNING
    return seqs


def unexpected(seq, error):
    raise AssertionError(f"{seq.request_id} failed: {error}")


def before(sampler, appender, seqs, logits_cycle, steps) -> float:
    t0 = time.process_time()
    for k in range(steps):
        assert sampler.all_greedy(seqs)
        tokens = logits_cycle[k % len(logits_cycle)].float().argmax(dim=-1).tolist()
        appender(seqs, tokens, [None] * len(tokens), unexpected)
    return (time.process_time() - t0) / steps


def per_row(sampler, appender, seqs, logits_cycle, steps) -> float:
    t0 = time.process_time()
    for k in range(steps):
        tokens, logprobs = sampler(logits_cycle[k % len(logits_cycle)], seqs)
        appender(seqs, tokens, logprobs, unexpected)
    return (time.process_time() - t0) / steps


def batched(sampler, appender, seqs, logits_cycle, steps) -> tuple[float, float, float]:
    appender.batch_stops(seqs)  # makes the rows' StopRules
    t0 = time.process_time()
    assert sampler.all_greedy(seqs)
    stops = appender.batch_stops(seqs)
    lengths = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
    t1 = time.process_time()
    for k in range(steps):
        tensor, tokens = sampler.greedy(logits_cycle[k % len(logits_cycle)])
        lengths += 1
        appender.append_batch(seqs, tokens, stops, lengths, unexpected, tensor.numpy())
    t2 = time.process_time()
    stops.keep(list(range(1, len(seqs))))  # the batch after its first row stopped
    return (time.process_time() - t1) / steps, t1 - t0, time.process_time() - t2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    logits_cycle = []
    for _ in range(8):
        x = torch.randn(a.rows, a.vocab, generator=g)
        x[:, list(EOS)] = -30.0  # looked up, never chosen: the batch keeps its rows
        logits_cycle.append(x)
    sampler = Sampler(eos_ids=EOS)
    appender = TokenAppender(set(EOS), 1 << 20, None, lambda seq, reason: unexpected(seq, reason))
    rng = np.random.default_rng(0)
    old, row, new, once, kept = [], [], [], [], []
    for path in (before, per_row, batched):  # warm-up
        path(sampler, appender, batch(a.rows, a.vocab, rng), logits_cycle, 20)
    for _ in range(a.repeats):
        old.append(before(sampler, appender, batch(a.rows, a.vocab, rng), logits_cycle, a.steps))
        row.append(per_row(sampler, appender, batch(a.rows, a.vocab, rng), logits_cycle, a.steps))
        step, setup, keep = batched(sampler, appender, batch(a.rows, a.vocab, rng), logits_cycle, a.steps)
        new.append(step)
        once.append(setup)
        kept.append(keep)

    def show(xs):
        return f"{statistics.median(xs) * 1e3:.3f} ({min(xs) * 1e3:.3f}-{max(xs) * 1e3:.3f}) ms"
    print(f"{a.rows} rows, vocabulary {a.vocab}, {a.steps} steps x {a.repeats} repeats, load {os.getloadavg()}")
    print(f"before   (torch argmax + __call__):    {show(old)} per step")
    print(f"per-row  (__call__ + __call__):        {show(row)} per step")
    print(f"batch    (greedy + append_batch):      {show(new)} per step")
    for name, xs in (("per-row", row), ("batch", new)):
        print(f"{name} / before: {statistics.median(n / o for n, o in zip(xs, old)):.2f}x "
              f"(median of the repeats' ratios)")
    print(f"once per batch (all_greedy + batch_stops):{show(once)}")
    print(f"BatchStops.keep (one row dropped):     {show(kept)}")


if __name__ == "__main__":
    main()
