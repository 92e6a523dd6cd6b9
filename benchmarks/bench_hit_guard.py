"""What the prefix-hit guard costs (issue 26 goal: < 5% throughput at verify_cache_hits = 0.01):
the same prefix-sharing workload through two engines, p = 0 and p = 0.01 (and p = 1, the cost of
checking every hit), alternating, on the built-in hybridkv/tiny-code, CPU, 1 torch thread.

    python benchmarks/bench_hit_guard.py                 # 5 repeats, ~1 minute on 2 CPU cores
    python benchmarks/bench_hit_guard.py --repeats 1 --requests 16   # a smoke run

Each repeat: `--requests` requests in one generate() call, over 8 fresh prefixes of 256 tokens
(each request its prefix + 32 tokens of its own; greedy, 32 output tokens, at most 16 running), so
nearly every request is a prefix hit. Throughput = generated tokens / CPU seconds of the call
(the shadows' cold prefills included: generate() returns once the checks it started are done).
Printed: median (min-max) tokens/s per p, the checks run, and the ratio to p = 0 from the same run.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.cpu_threads import ENV_VAR

MODEL = str(Path(__file__).resolve().parents[1] / "hybridkv" / "builtin_models" / "tiny-code")


def workload(seed: int, requests: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 4000) for _ in range(256)] for _ in range(8)]
    return [prefixes[i % 8] + [rng.randrange(4, 4000) for _ in range(32)] for i in range(requests)]


def run_once(llm: LLM, prompts) -> tuple[float, int, int]:
    """(CPU seconds, generated tokens, checks run) of one generate() call."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    checks = llm.stats()["cache_hit_checks"]
    c0 = time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    cpu = time.process_time() - c0
    return cpu, sum(len(o.outputs[0].token_ids) for o in outs), llm.stats()["cache_hit_checks"] - checks


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--fractions", default="0,0.01,1", help="comma-separated p; the first is the baseline")
    args = ap.parse_args(argv)
    os.environ[ENV_VAR] = "1"  # LLM sets its threads from it (hybridkv/cpu_threads.py)
    torch.set_num_threads(1)
    fractions = [float(x) for x in args.fractions.split(",")]
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread, torch {torch.__version__}, "
          f"model hybridkv/tiny-code, {args.requests} requests x 32 tokens per repeat")
    engines = {p: LLM(MODEL, max_num_seqs=16, memory_budget_bytes=256 << 20, verify_cache_hits=p) for p in fractions}
    rates = {p: [] for p in fractions}
    checks = {p: 0 for p in fractions}
    tokens = None
    for r in range(-1, args.repeats):  # r = -1: warm-up, not reported
        prompts = workload(r + 1, args.requests)
        order = fractions if r % 2 == 0 else fractions[::-1]
        for p in order:
            cpu, n, c = run_once(engines[p], prompts)
            if tokens is not None and n != tokens:
                raise RuntimeError(f"p={p} generated {n} tokens, expected {tokens}")
            tokens = n
            if r >= 0:
                rates[p].append(n / cpu)
                checks[p] += c
    base = statistics.median(rates[fractions[0]])
    out = {}
    for p in fractions:
        xs = rates[p]
        med = statistics.median(xs)
        out[p] = {"tokens_per_cpu_s": xs, "checks": checks[p], "ratio": med / base}
        print(f"  verify_cache_hits={p:<5}: {med:8.1f} tok/CPU-s ({min(xs):.1f}-{max(xs):.1f}), "
              f"{checks[p]:4d} hits checked, {med / base:.3f}x p={fractions[0]}")
    return out


if __name__ == "__main__":
    main()
