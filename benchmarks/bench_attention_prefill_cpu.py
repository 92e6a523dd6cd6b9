"""One attention layer's prefill chunk over cached context on CPU: the two LSE-merged flash pieces
(kernels/attention_cpu.py) against the boolean-mask SDPA call they replace (the path older torch
keeps), both through `paged_attention_cpu` on the same paged pool.

    python benchmarks/bench_attention_prefill_cpu.py --repeats 7

1 torch thread, CPU time (`time.process_time`), the two paths alternating in each repeat (which
goes first alternates too); median over repeats (min-max). Shapes of bench_engine.py's model:
4 query / 2 KV heads of 64, blocks of 16, fp32. Each case is (new tokens, cached tokens).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hybridkv.kernels.attention_cpu as attention_cpu

CASES = [(1024, 1024), (512, 1536), (2048, 2048), (256, 256)]


def chunk(new: int, cached: int, bs=16, hkv=2, group=2, d=64, seed=0):
    """q [new, Hq, D] and a pool holding one request's new + cached tokens in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    n_blk = -(-(new + cached) // bs)
    kv = torch.randn(n_blk + 4, 2, bs, hkv, d, generator=g)
    table = torch.randperm(n_blk + 4, generator=g)[:n_blk].to(torch.int32).view(1, -1)
    q = torch.randn(new, hkv * group, d, generator=g)
    qsl = torch.tensor([0, new], dtype=torch.int32)
    return q, kv, qsl, torch.tensor([new + cached], dtype=torch.int32), table


def timed(fn) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: must be >= 1")
    if attention_cpu._FLASH_WITH_LSE is None:
        raise SystemExit("this torch has no _scaled_dot_product_flash_attention_for_cpu: "
                         "only the mask path exists, nothing to compare")
    torch.set_num_threads(1)
    flash = attention_cpu._FLASH_WITH_LSE

    def run(inputs, use_flash):
        attention_cpu._FLASH_WITH_LSE = flash if use_flash else None
        try:  # no plan cache: the plan (mask or not) is part of each path's cost
            return attention_cpu.paged_attention_cpu(*inputs, 0.125)
        finally:
            attention_cpu._FLASH_WITH_LSE = flash

    print(f"torch {torch.__version__}, 1 thread, {args.repeats} repeats, CPU ms: median (min-max)")
    print("| new over cached | boolean mask | LSE-merged pieces | speed-up | max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    for new, cached in CASES:
        inputs = chunk(new, cached)
        diff = (run(inputs, False) - run(inputs, True)).abs().max().item()
        times = {False: [], True: []}
        for r in range(args.repeats):
            for use_flash in ((False, True) if r % 2 == 0 else (True, False)):
                times[use_flash].append(timed(lambda: run(inputs, use_flash)))
        ms = {k: [1e3 * t for t in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in ms.items()}
        cell = lambda k: f"{med[k]:.1f} ({min(ms[k]):.1f}-{max(ms[k]):.1f})"
        print(f"| {new} over {cached} | {cell(False)} | {cell(True)} | "
              f"{med[False] / med[True]:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
