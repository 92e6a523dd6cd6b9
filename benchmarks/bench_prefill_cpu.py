"""The Mamba2 prefill on CPU before and after the C prefill kernels (issue 12), one process.

    python benchmarks/bench_prefill_cpu.py                    # 5 repeats, before = 98a6b3d
    python benchmarks/bench_prefill_cpu.py --quick            # a smoke run (fewer tokens)
    python benchmarks/bench_prefill_cpu.py --before <commit> --repeats 7

"before" is the chunked SSD scan and the causal conv (kernels/mamba2_cpu.py, causal_conv_cpu.py
and their chunk_layout.py) as they stood at --before, loaded from git and patched in where the
dispatcher finds them; "after" is this tree's (the C kernels of mamba2_prefill_native.py where
they can run). Everything else (projections, norms, attention) is this tree's in both. Each repeat
runs both alternating (which goes first alternates too) on the same inputs; a repeat's figure is
CPU time (`time.process_time`), 1 torch thread. Printed: median and min-max per variant, the
before/after ratio of the medians, the load average, and the check that both agree (layer: max
relative error of output and states; engine: the greedy tokens).
Cases, with bench_engine.py's Bamba model (hidden 256, 8 layers, attention at 3 and 7, Mamba2 8
heads x 64, 1 group, d_state 64, chunk 64, fp32):
- one Mamba2 layer (`Mamba2Mixer.forward`: in_proj, conv, SSD, gated norm, out_proj) prefilling
  14 fresh prompts of 32-256 tokens, and 1 x 2048 tokens; again with the chunk_size of real Bamba
  / Mamba2 checkpoints, 256 (this tree's CPU scan cuts chunks of 32 whatever the checkpoint says);
- the engine prefilling bench_engine.py's Bamba workload (32 prompts of 32-256 tokens) and long
  workload (8 prompts of 1k-2k tokens) with chunks of 2048 tokens, prefix caching off: every step
  until each request has its first token (`generate` with max_tokens 1).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

import hybridkv.kernels.causal_conv_cpu as conv_mod
import hybridkv.kernels.mamba2_cpu as scan_mod
from bench_cpu_kernels import baseline_module, mixer_case, rel_err
from bench_engine import CONFIGS
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint

BEFORE = "98a6b3d"  # main before the C prefill kernels


class Kernels:
    """Within the block, the dispatcher's prefill scan and conv are `scan` and `conv`."""

    def __init__(self, scan, conv):
        self.fns = {(scan_mod, "mamba2_chunk_scan_cpu"): scan, (conv_mod, "causal_conv1d_cpu"): conv}

    def __enter__(self):
        self.saved = {key: getattr(*key) for key in self.fns}
        for (mod, name), fn in self.fns.items():
            setattr(mod, name, fn)

    def __exit__(self, *exc):
        for (mod, name), fn in self.saved.items():
            setattr(mod, name, fn)


def alternate(variants: dict, repeats: int, inner: int) -> dict:
    """{name: [CPU seconds per call]}: each repeat runs every variant (warm call, then `inner`
    timed calls), the order reversed every other repeat."""
    times = {name: [] for name in variants}
    for r in range(repeats):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            with variants[name][0]:
                variants[name][1]()
                t0 = time.process_time()
                for _ in range(inner):
                    variants[name][1]()
                times[name].append((time.process_time() - t0) / inner)
    return times


def fmt(ts):
    return f"{statistics.median(ts) * 1e3:.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"


def row(label, t, check):
    ratio = statistics.median(t["before"]) / statistics.median(t["after"])
    print(f"| {label} | {fmt(t['before'])} | {fmt(t['after'])} | {ratio:.2f}x | {check} |", flush=True)


def layer_rows(kernels, lens_cases, repeats):
    for label, lens, chunk in lens_cases:
        mixer, batch, hidden, conv, state = mixer_case(prompt_lens=lens)
        mixer.chunk_size = chunk
        pools = {name: (conv.clone(), state.clone()) for name in kernels}
        calls = {name: (kernels[name], lambda name=name: mixer(hidden, batch, *pools[name]))
                 for name in kernels}
        with torch.no_grad():
            outs = {}
            for name, (ctx, fn) in calls.items():
                with ctx:
                    outs[name] = fn()
            err = max(rel_err(outs["after"], outs["before"]),
                      rel_err(pools["after"][1], pools["before"][1]),
                      rel_err(pools["after"][0], pools["before"][0]))
            t = alternate(calls, repeats, 1)
        row(label, t, f"max rel err {err:.1e}")


def engine_rows(kernels, quick, repeats):
    q = 4 if quick else 1
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint("bamba", d, **CONFIGS["bamba"])
        llm = LLM(str(path), memory_budget_bytes=256 << 20, max_num_seqs=32,
                  max_num_batched_tokens=2048, enable_prefix_caching=False)  # every call prefills all
        for n, lo, hi in [(32 // q, 32 // q, 256 // q), (8 // q, 1024 // q, 2048 // q)]:
            rng = random.Random(0)
            prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
            tokens = {}

            def prefill(name):
                out = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                   use_tqdm=False)
                tokens[name] = [o.outputs[0].token_ids[0] for o in out]

            calls = {name: (kernels[name], lambda name=name: prefill(name)) for name in kernels}
            t = alternate(calls, repeats, 1)
            same = sum(a == b for a, b in zip(tokens["before"], tokens["after"]))
            row(f"engine prefill, {n} prompts of {lo}-{hi} tokens ({sum(map(len, prompts))} tokens)", t,
                f"first tokens identical {same}/{n}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", default=BEFORE, help="the commit whose scan and conv are 'before'")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter prompts (a smoke run)")
    ap.add_argument("--only", choices=["layer", "engine"], help="one of the two tables")
    args = ap.parse_args()
    torch.set_num_threads(1)
    old_scan = baseline_module("mamba2_cpu", args.before, ("chunk_layout",))
    old_conv = baseline_module("causal_conv_cpu", args.before)
    kernels = {"before": Kernels(old_scan.mamba2_chunk_scan_cpu, old_conv.causal_conv1d_cpu),
               "after": Kernels(scan_mod.mamba2_chunk_scan_cpu, conv_mod.causal_conv1d_cpu)}
    print(f"# before = {args.before}, after = this tree; {args.repeats} repeats, CPU time, 1 thread; "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("| case | before: median (min-max) | after: median (min-max) | before / after | check |")
    print("| --- | --- | --- | --- | --- |")
    q = 4 if args.quick else 1
    rng = torch.Generator().manual_seed(1)
    mixed = torch.randint(32 // q, 256 // q + 1, (14,), generator=rng).tolist()
    if args.only in (None, "layer"):
        layer_rows(kernels, [(f"Mamba2 layer prefill, 14 prompts ({sum(mixed)} tokens)", mixed, 64),
                             (f"Mamba2 layer prefill, 1 x {2048 // q} tokens", [2048 // q], 64),
                             ("same, 14 prompts, checkpoint chunk_size 256", mixed, 256),
                             (f"same, 1 x {2048 // q} tokens, checkpoint chunk_size 256", [2048 // q], 256)],
                   args.repeats)
    if args.only in (None, "engine"):
        engine_rows(kernels, args.quick, args.repeats)
    print(f"# load average at the end {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
