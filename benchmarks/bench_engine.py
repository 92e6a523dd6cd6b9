"""Engine throughput against transformers' `generate`, and the scheduler+manager cost of a step.

    python benchmarks/bench_engine.py                 # both parts, the issue-5 workload
    python benchmarks/bench_engine.py --part overhead # only the 256-request step overhead
    python benchmarks/bench_engine.py --quick         # small sizes (a smoke run, not a result)

Part 1 (throughput): one tiny random Bamba (8 layers, hidden 256, attention at layers 3 and 7),
32 prompts of 32-256 random tokens, 64 new tokens each, greedy, EOS ignored. transformers runs
them as ONE left-padded batch through `model.generate`; hybridkv runs them through
`LLM.generate` (continuous batching, chunked prefill). Both are timed end to end (prefill
included) and their greedy tokens are compared (they must agree on most requests: fp32 sums in
another order may flip a near-tie). Printed: generated tokens/s of each and the ratio.

Part 2 (overhead): 256 running requests decode with the model forward replaced by a stub that
returns zero logits of the right shape, so a step is only Python bookkeeping: the scheduler's
`schedule()` (with the manager's allocate), the engine's batch-metadata build (`_batch`), and
the manager's `commit` (sampled tokens go into the sequence's own list, which the manager
reads: no copy to time). Printed: the median per step of that sum, and of the
whole `step()` (sampling and stop checks included).
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import make_tiny_checkpoint

BENCH_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                    attn_layer_indices=[3, 7], num_attention_heads=4, num_key_value_heads=2,
                    mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
                    mamba_chunk_size=64, vocab_size=512, max_position_embeddings=1024)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_transformers(path, prompts, new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds for one left-padded greedy batch through HF generate; its new tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # pad id 0
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False,
                    pad_token_id=0)  # warm-up: first-call allocations and lazy imports
        t0, c0 = time.perf_counter(), time.process_time()
        out = hf.generate(ids, **kw)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return secs, cpu, [row[width:].tolist() for row in out]


def run_hybridkv(path, prompts, new_tokens: int, max_batched: int) -> tuple[float, float, list[list[int]], dict]:
    """Wall and CPU seconds of LLM.generate over the prompts; the new tokens; the engine's stats."""
    llm = LLM(str(path), memory_budget_bytes=256 << 20, max_num_seqs=len(prompts),
              max_num_batched_tokens=max_batched)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return secs, cpu, [o.outputs[0].token_ids for o in outs], llm.stats()


def part_throughput(args) -> dict:
    cfg = dict(BENCH_CONFIG)
    if args.quick:
        cfg.update(num_hidden_layers=4, attn_layer_indices=[1, 3])
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint("bamba", d, **cfg)
        n, lo, hi, new = (8, 16, 64, 8) if args.quick else (32, 32, 256, 64)
        prompts = make_prompts(n, lo, hi, cfg["vocab_size"])
        ours, hf, cpu_ratio = [], [], []
        for _ in range(args.repeats):
            s_ours, c_ours, t_ours, stats = run_hybridkv(path, prompts, new, args.max_batched_tokens)
            s_hf, c_hf, t_hf = run_transformers(path, prompts, new)
            ours.append(s_ours)
            hf.append(s_hf)
            cpu_ratio.append(c_hf / c_ours)
            print(f"  run: hybridkv {s_ours:.2f} s wall ({c_ours:.2f} s CPU), transformers {s_hf:.2f} s "
                  f"wall ({c_hf:.2f} s CPU)", flush=True)
    same = sum(a == b for a, b in zip(t_ours, t_hf))
    gen = n * new
    res = {"ours_tps": gen / statistics.median(ours), "hf_tps": gen / statistics.median(hf),
           "same": same, "n": n, "prompt_tokens": sum(map(len, prompts)), "steps": stats["steps"]}
    res["ratio"] = res["ours_tps"] / res["hf_tps"]
    res["cpu_ratio"] = statistics.median(cpu_ratio)
    print(f"throughput: {n} prompts ({res['prompt_tokens']} prompt tokens), {new} new tokens each, "
          f"{res['steps']} engine steps")
    print(f"  hybridkv      {res['ours_tps']:8.1f} generated tok/s (median of {args.repeats})")
    print(f"  transformers  {res['hf_tps']:8.1f} generated tok/s (one left-padded batch)")
    print(f"  ratio         {res['ratio']:8.2f}x wall, {res['cpu_ratio']:.2f}x CPU time; greedy outputs "
          f"identical on {same}/{n} requests")
    return res


class _StubModel:
    """Stands in for the model in part 2: zero logits [R, vocab], no forward pass."""

    def __init__(self, model):
        self.vocab_size, self.device = model.vocab_size, model.device

    def __call__(self, batch, caches):
        return torch.zeros(batch.num_reqs, self.vocab_size)


@contextmanager
def _timed(obj, name: str, acc: list):
    """Wrap obj.name so each call adds its seconds to acc[0]."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t0

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        delattr(obj, name)


def part_overhead(args) -> dict:
    num_reqs, steps = (32, 10) if args.quick else (256, 50)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint("bamba", d)  # the 4-layer tiny config: the model never runs
        llm = LLM(str(path), memory_budget_bytes=256 << 20, max_num_seqs=num_reqs,
                  max_num_batched_tokens=8192)
    eng = llm.engine
    eng.model = _StubModel(llm.model)
    params = SamplingParams(max_tokens=10_000 if not args.quick else 100, temperature=0.0, ignore_eos=True)
    for p in make_prompts(num_reqs, 16, 200, llm.model.vocab_size, seed=1):
        llm.add_request(p, params)
    while any(eng.mgr.request(r.request_id).num_computed_tokens < len(r.prompt_token_ids)
              for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill everyone
    assert len(eng.scheduler.running) == num_reqs
    sched, batch, mgr, whole = [], [], [], []
    for _ in range(steps):
        acc_s, acc_b, acc_m = [0.0], [0.0], [0.0]
        with _timed(eng.scheduler, "schedule", acc_s), _timed(eng, "_batch", acc_b), \
                _timed(eng.mgr, "commit", acc_m), \
                _timed(eng.mgr, "checkpoint", acc_m):
            t0 = time.perf_counter()
            outs = eng.step()
            whole.append(time.perf_counter() - t0)
        assert len(outs) == num_reqs
        sched.append(acc_s[0])
        batch.append(acc_b[0])
        mgr.append(acc_m[0])
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    core = [a + b + c for a, b, c in zip(sched, batch, mgr)]
    res = {"num_reqs": num_reqs, "schedule_ms": ms(sched), "batch_ms": ms(batch), "manager_ms": ms(mgr),
           "core_ms": ms(core), "step_ms": ms(whole)}
    print(f"overhead: {num_reqs} running decodes, stub forward, median of {steps} steps")
    print(f"  schedule() {res['schedule_ms']:.3f} ms + batch build {res['batch_ms']:.3f} ms + "
          f"manager commit {res['manager_ms']:.3f} ms = {res['core_ms']:.3f} ms per step")
    print(f"  whole step() with sampling and stop checks: {res['step_ms']:.3f} ms")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["all", "throughput", "overhead"], default="all")
    ap.add_argument("--repeats", type=int, default=1, help="throughput runs; the median is printed")
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = ap.parse_args(argv)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} "
          f"torch threads, torch {torch.__version__}, python {platform.python_version()}")
    if args.part in ("all", "throughput"):
        part_throughput(args)
    if args.part in ("all", "overhead"):
        part_overhead(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
