"""One attention layer's CPU decode step: the C kernel reading K/V in place from the paged pool
(kernels/attention_decode_native.py) against the torch path (length buckets, a gather of whole
blocks, two batched matmuls), both through `paged_attention_cpu` on the same pool.

    python benchmarks/bench_attention_decode_cpu.py --repeats 7
    python benchmarks/bench_attention_decode_cpu.py --engine --steps 40

1 torch thread, CPU time (`time.process_time`), the two paths alternating in each repeat (which
goes first alternates too); median over repeats (min-max) of the time per layer of a step of
`--layers` layers sharing one step plan (built by the first, as in the engine). Shapes of
bench_engine.py's models: 4 query / 2 KV heads of 64, blocks of 16, fp32, blocks shuffled in a
pool with spare blocks. Also prints skewed / uniform (31 x 64 + 1 x 2048 over 32 x 64) per path.

--engine: whole decode steps of bench_engine.py's tiny Llama (8 layers) in the engine, 32
requests with prompts of 32-256 tokens, steps alternating native / torch path (adjacent steps
hold nearly the same contexts); median step CPU time per path and the time inside
`paged_attention_cpu`.

--kernel-before COMMIT: the C kernel as it was at COMMIT (`git show`, built beside the current
one) against the current one, on a step of 8 layers each with its own pool (as in the engine,
no layer's K/V is in cache when it runs), 32 decodes of 100-330 tokens; also a C loop that only
reads the same K/V rows, the memory floor.
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridkv.kernels import native_cpu
from hybridkv.kernels.attention_cpu import paged_attention_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_kernels import attention_case  # noqa: E402 (the same decode inputs)

_rng = random.Random(0)
CASES = {
    "32 decodes of 32-320 tokens": [_rng.randint(32, 320) for _ in range(32)],
    "batch 1, 128 tokens": [128],
    "32 x 64 (uniform)": [64] * 32,
    "31 x 64 + 1 x 2048 (skewed)": [64] * 31 + [2048],
}


def decode_step(lens: list[int], seed=0):
    """bench_cpu_kernels.attention_case with as many spare blocks as used ones (+8), the requests'
    blocks shuffled among them: q [R, Hq, D], kv, query_start_loc, seq_lens, block table."""
    return attention_case(lens, seed=seed, spare_blocks=sum(-(-n // 16) for n in lens) + 8)


def step(inputs, layers: int, native: bool):
    plans = {}  # one step: the first layer builds the plan, the others reuse it
    if native:
        for _ in range(layers):
            out = paged_attention_cpu(*inputs, 0.125, plan_cache=plans)
        return out
    with native_cpu.forced_off():
        for _ in range(layers):
            out = paged_attention_cpu(*inputs, 0.125, plan_cache=plans)
    return out


def engine_steps(steps: int):
    """Decode steps of the tiny Llama at batch 32, native and torch path alternating."""
    import tempfile

    import hybridkv.kernels.attention_cpu as attention_cpu
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine import CONFIGS
    from hybridkv import LLM, SamplingParams
    from hybridkv.models.tiny import make_tiny_checkpoint

    inner, spent = attention_cpu.paged_attention_cpu, [0.0]

    def counted(*a, **k):
        c0 = time.process_time()
        try:
            return inner(*a, **k)
        finally:
            spent[0] += time.process_time() - c0

    attention_cpu.paged_attention_cpu = counted
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(str(make_tiny_checkpoint("llama", d, **CONFIGS["llama"])), memory_budget_bytes=256 << 20,
                  max_num_seqs=32, max_num_batched_tokens=2048)
        rng = random.Random(0)
        for _ in range(32):
            llm.add_request([rng.randrange(4, 512) for _ in range(rng.randint(32, 256))],
                            SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True))
        for _ in range(8):  # the prompts' ~4.6k tokens prefill in 3 steps of 2048: then all decode
            llm.engine.step()
        times = {True: [], False: []}
        for i in range(steps):
            native = i % 2 == 0
            spent[0] = 0.0
            c0 = time.process_time()
            if native:
                llm.engine.step()
            else:
                with native_cpu.forced_off():
                    llm.engine.step()
            times[native].append((1e3 * (time.process_time() - c0), 1e3 * spent[0]))
    print(f"torch {torch.__version__}, 1 thread, {steps} decode steps at batch 32, CPU ms per step: "
          "median (min-max)")
    print("| path | decode step | inside paged_attention_cpu |")
    print("| --- | --- | --- |")
    for native in (False, True):
        step_ms, attn_ms = zip(*times[native])
        print(f"| {'native' if native else 'torch path'} | {statistics.median(step_ms):.2f} "
              f"({min(step_ms):.2f}-{max(step_ms):.2f}) | {statistics.median(attn_ms):.2f} "
              f"({min(attn_ms):.2f}-{max(attn_ms):.2f}) |")
    ratio = statistics.median(t for t, _ in times[False]) / statistics.median(t for t, _ in times[True])
    print(f"decode step, torch path / native: {ratio:.2f}x")


# reads every K and V row a decode sees, in the kernel's order, and nothing else
READ_ONLY_SRC = r"""
#include <stdint.h>
#include <string.h>
typedef float v8 __attribute__((vector_size(32)));
int64_t paged_decode_attention(const float *q, int64_t q_tok, int64_t q_head, const float *kv,
    int64_t num_blocks, int64_t kv_blk, int64_t kv_half, int64_t kv_pos, int64_t kv_head,
    const int32_t *table, int64_t table_row, const int32_t *seq_lens, const int32_t *reqs,
    const int32_t *rows, int64_t n, int64_t hkv, int64_t group, int64_t d, int64_t bs, float scale,
    float soft_cap, int64_t window, const float *sinks, float *out, int64_t out_tok, int64_t out_head) {
    for (int64_t i = 0; i < n; i++) {
        v8 acc = {0};
        const int64_t len = seq_lens[reqs[i]];
        const int32_t *blocks = table + reqs[i] * table_row;
        for (int64_t b = 0, j = 0; j < len; b++) {
            const int64_t nk = bs < len - j ? bs : len - j;
            const float *k = kv + blocks[b] * kv_blk;
            j += nk;
            for (int64_t x = 0; x < nk * kv_pos; x += 8) {
                v8 a, c;
                memcpy(&a, k + x, sizeof a);
                memcpy(&c, k + kv_half + x, sizeof c);
                acc += a + c;
            }
        }
        memcpy(out + rows[i] * out_tok, &acc, sizeof acc);
    }
    return 0;
}
"""


def kernel_versions(before: str, repeats: int):
    """The kernel at `before` vs the current one vs a read-only loop, alternating."""
    from hybridkv.kernels import attention_decode_native as native

    repo = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{before}:kernels/native/paged_attention.c"], cwd=repo,
                         capture_output=True, text=True)
    if src.returncode != 0:
        raise SystemExit(f"git show {before}:kernels/native/paged_attention.c failed: {src.stderr.strip()}")
    kernels = {"current": native.PAGED_DECODE_ATTENTION.function()}
    with tempfile.TemporaryDirectory() as d:
        for name, text in ((before, src.stdout), ("read only", READ_ONLY_SRC)):
            sub = Path(d) / name.replace(" ", "_")
            sub.mkdir()
            (sub / "paged_attention.c").write_text(text)
            cf = native.PAGED_DECODE_ATTENTION  # its entry point, built with that source
            lib = native_cpu.library("paged_attention", sub, extra=cf.source)
            if lib is None:
                raise SystemExit(f"the kernel at {name} did not build (or its prototype is not this declaration's)")
            fn = lib[cf.entry]
            fn.argtypes, fn.restype = cf.argtypes, cf.restype
            kernels[name] = fn
    rng = random.Random(1)
    lens = [rng.randint(100, 330) for _ in range(32)]
    layers = [decode_step(lens, seed=s) for s in range(8)]  # 8 pools, ~20 MB each

    def run(name):
        with native.PAGED_DECODE_ATTENTION.replaced(kernels[name]):
            plans = {}
            return [paged_attention_cpu(*inputs, 0.125, plan_cache=plans) for inputs in layers]

    diff = max((a - b).abs().max().item() for a, b in zip(run("current"), run(before)))
    times = {name: [] for name in kernels}
    order = list(kernels)
    for r in range(repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            c0 = time.process_time()
            run(name)
            times[name].append(1e3 * (time.process_time() - c0) / len(layers))
    print(f"torch {torch.__version__}, 1 thread, {repeats} repeats; 8 layers, each its own pool, "
          f"32 decodes, {sum(lens)} keys a layer; CPU ms per layer: median (min-max); "
          f"current vs {before}: max abs diff {diff:.1e}")
    for name in order:
        print(f"| {name} | {statistics.median(times[name]):.3f} ({min(times[name]):.3f}-"
              f"{max(times[name]):.3f}) |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8, help="attention layers per step (one plan)")
    ap.add_argument("--engine", action="store_true", help="whole decode steps of the tiny Llama instead")
    ap.add_argument("--steps", type=int, default=40, help="--engine: decode steps (half per path)")
    ap.add_argument("--kernel-before", default="", metavar="COMMIT",
                    help="the C kernel at COMMIT against the current one")
    args = ap.parse_args()
    if args.repeats < 1 or args.layers < 1 or args.steps < 2:
        raise SystemExit(f"--repeats {args.repeats} / --layers {args.layers} / --steps {args.steps}: "
                         "must be >= 1 / >= 1 / >= 2")
    torch.set_num_threads(1)
    if not native_cpu.enabled() or native_cpu.library("paged_attention") is None:
        raise SystemExit("the native kernel is off or not built here (HYBRIDKV_CPU_NATIVE, a C "
                         "compiler): only the torch path exists, nothing to compare")
    if args.engine:
        return engine_steps(args.steps)
    if args.kernel_before:
        return kernel_versions(args.kernel_before, args.repeats)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} repeats, {args.layers} layers a step, "
          "CPU ms per layer: median (min-max)")
    print("| decodes | torch path | native | speed-up | max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    medians = {}
    for name, lens in CASES.items():
        inputs = decode_step(lens)
        diff = (step(inputs, 1, False) - step(inputs, 1, True)).abs().max().item()
        times = {False: [], True: []}
        for r in range(args.repeats):
            for native in ((False, True) if r % 2 == 0 else (True, False)):
                c0 = time.process_time()
                step(inputs, args.layers, native)
                times[native].append(1e3 * (time.process_time() - c0) / args.layers)
        med = {k: statistics.median(v) for k, v in times.items()}
        medians[name] = med
        cell = lambda k: f"{med[k]:.3f} ({min(times[k]):.3f}-{max(times[k]):.3f})"
        print(f"| {name} | {cell(False)} | {cell(True)} | {med[False] / med[True]:.2f}x | {diff:.1e} |")
    uni, skew = medians["32 x 64 (uniform)"], medians["31 x 64 + 1 x 2048 (skewed)"]
    print(f"skewed / uniform: torch path {skew[False] / uni[False]:.2f}x, native {skew[True] / uni[True]:.2f}x")


if __name__ == "__main__":
    main()
