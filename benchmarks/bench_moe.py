"""The MoE block on CPU before and after issue 13 item 3, same weights and inputs, one process.

    python benchmarks/bench_moe.py               # 7 repeats
    python benchmarks/bench_moe.py --repeats 5 --quick

"before" is models/moe.py's SparseMoE at BASELINE (loaded from git, so the script needs the
repository's history): a Python loop over the experts that received tokens (`unique().tolist()`,
then per expert `where`, three Linear calls, the weight and an `index_put_`). "after" is the
installed SparseMoE: experts stacked, pairs sorted by expert, `torch._grouped_mm` per projection
(`hybridkv.kernels.fused_moe` on CPU). Both compute the whole block (router, top-k, experts) in
fp32 on one torch thread. Each repeat times both alternating on the same input; a repeat's time is
CPU time (`time.process_time`) per call, averaged over `--inner` calls. Printed: median and
min-max of each, the before/after ratio of the medians, and the relative max error between them.
Shapes: the tiny MoE checkpoints' (hidden 64, 4 experts, top-2; intermediate 96 as Jamba's tiny
one), and a wider one (hidden 512, 64 experts, top-8, intermediate 256, Qwen3-Next-like routing).
Tokens: 1 and 32 (decode batches), 512 (a prefill chunk).
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from hybridkv.models.moe import SparseMoE

BASELINE = "d976b14"  # main before the fused MoE
ROOT = Path(__file__).resolve().parents[1]


def baseline_moe_class():
    """SparseMoE from models/moe.py at BASELINE, imported inside hybridkv.models."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE}:models/moe.py"],
                         check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("hybridkv.models._baseline_moe", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "hybridkv.models"
    exec(compile(src, f"{BASELINE}:models/moe.py", "exec"), mod.__dict__)
    return mod.SparseMoE


def pair(hidden, inter, experts, top_k, norm, seed=0):
    """(before, after) blocks holding the same random weights."""
    torch.manual_seed(seed)
    after = SparseMoE(hidden, inter, experts, top_k, norm).eval()
    for p in after.parameters():
        p.data.normal_(0, 0.2)
    before = baseline_moe_class()(hidden, inter, experts, top_k, norm).eval()
    before.router.weight.data.copy_(after.router.weight)
    for e, mlp in enumerate(before.experts):
        gate, up = after.experts.gate_up_proj[e].chunk(2, dim=0)
        mlp.gate_proj.weight.data.copy_(gate)
        mlp.up_proj.weight.data.copy_(up)
        mlp.down_proj.weight.data.copy_(after.experts.down_proj[e])
    return before, after


@torch.no_grad()
def time_case(before, after, x, repeats, inner):
    times = {"before": [], "after": []}
    fns = {"before": before, "after": after}
    for fn in fns.values():  # warm-up
        fn(x)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(inner):
                fn(x)
            times[name].append((time.process_time() - t0) / inner)
    a, b = before(x), after(x)
    return times, ((a - b).abs().max() / a.abs().max()).item()


def fmt(ts):
    return f"{statistics.median(ts) * 1e3:.3f} ms ({min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="fewer calls per repeat")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
          f"1 thread, {args.repeats} repeats, CPU time per call")
    print("| block | tokens | before: median (min-max) | after: median (min-max) | before / after "
          "| rel. err |")
    print("| --- | --- | --- | --- | --- | --- |")
    shapes = {"tiny (H 64, I 96, E 4, k 2)": (64, 96, 4, 2, False),
              "wide (H 512, I 256, E 64, k 8)": (512, 256, 64, 8, True)}
    for label, (h, i, e, k, norm) in shapes.items():
        before, after = pair(h, i, e, k, norm)
        for tokens in (1, 32, 512):
            inner = max(1, (200 if tokens == 1 else 40 if tokens == 32 else 4) // (4 if args.quick else 1))
            inner = max(1, inner // (8 if h > 64 else 1))
            x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(tokens))
            t, err = time_case(before, after, x, args.repeats, inner)
            ratio = statistics.median(t["before"]) / statistics.median(t["after"])
            print(f"| {label} | {tokens} | {fmt(t['before'])} | {fmt(t['after'])} | {ratio:.2f}x "
                  f"| {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
