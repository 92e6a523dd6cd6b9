"""hybridkv's engine against transformers' `generate` on CPU, and the scheduler+manager cost of a step.

    python benchmarks/bench_engine.py                    # every workload, 5 repeats, then overhead
    python benchmarks/bench_engine.py --only bamba,skewed --repeats 7
    python benchmarks/bench_engine.py --part overhead    # only the 256-request step overhead
    python benchmarks/bench_engine.py --quick            # small sizes (CI-sized smoke run)

Part 1 (workloads): tiny random checkpoints (hidden 256, 8 layers, fp32; Bamba with attention at
layers 3 and 7, Llama of the same shape), greedy, EOS ignored, 1 torch thread (`--threads`).
In each repeat both systems run the same fresh prompts (seeded by the repeat, so our prefix cache
never hits a previous repeat), one after the other, alternating which goes first. transformers
runs each group of at most `max_at_once` requests as one left-padded batch through `generate`
(a group generates its longest request's count; shorter ones are cut), hybridkv runs all of them
through `LLM.generate` (continuous batching, chunked prefill, prefix caching). Per workload:
the median over repeats of transformers' CPU time / ours (min-max), the same for wall time, and
ours split per engine step into model forward and the rest (engine overhead), plus the median
forward time of a decode-only step. The skewed batch (31 x 64 + 1 x 2048 tokens) and the uniform
one (32 x 64) print their decode-step forward ratio (the issue's goal: <= 1.5x).

Part 2 (overhead): 256 running requests decode with the model forward replaced by a stub that
returns zero logits of the right shape, so a step is only Python bookkeeping: `schedule()`,
the batch build (`BatchBuilder.build`) and the manager's `commit`; median per step, and the whole `step()`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.cpu_threads import ENV_VAR
from hybridkv.decode_rows import DecodeRows
from hybridkv.models.tiny import make_tiny_checkpoint

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
CONFIGS = {
    "bamba": dict(SHAPE, attn_layer_indices=[3, 7], mamba_n_heads=8, mamba_d_head=64,
                  mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64),
    "llama": dict(SHAPE, head_dim=64),
}
QUICK = dict(num_hidden_layers=4)


@dataclass
class Workload:
    """prompts(rng) -> (prompts, max_tokens per request); max_at_once caps both systems' batch."""

    name: str
    family: str
    what: str
    make: Callable[[random.Random, int], tuple[list[list[int]], list[int]]]
    max_at_once: int = 32


def _toks(rng, n, vocab=512):
    return [rng.randrange(4, vocab) for _ in range(n)]


def workloads(quick: bool) -> list[Workload]:
    """The issue-12 table, plus the skewed / uniform pair and a shared-system-prompt burst."""
    q = 4 if quick else 1  # --quick divides counts and lengths

    def uniform_lengths(n, lo, hi, new):
        m = max(1, n // q)
        return lambda rng, _r: ([_toks(rng, rng.randint(lo // q, hi // q)) for _ in range(m)],
                                [new // q] * m)

    def variable(rng, _r):
        n = 64 // q
        return [_toks(rng, rng.randint(32, 256 // q)) for _ in range(n)], \
               [rng.randint(8, 256 // q) for _ in range(n)]

    def skewed(rng, _r):
        n = 32 // q
        return [_toks(rng, 64) for _ in range(n - 1)] + [_toks(rng, 2048 // q)], [64 // q] * n

    def burst(rng, _r):
        system = _toks(rng, 512 // q)
        n = 32 // q
        return [system + _toks(rng, rng.randint(20, 60)) for _ in range(n)], [64 // q] * n

    batch1 = uniform_lengths(1, 64, 64, 64)
    return [
        Workload("bamba", "bamba", "32 prompts of 32-256 tokens, 64 new",
                 uniform_lengths(32, 32, 256, 64)),
        Workload("llama", "llama", "same workload, Llama of the same shape",
                 uniform_lengths(32, 32, 256, 64)),
        Workload("variable", "bamba", "64 requests, max_tokens 8-256, at most 32 at once", variable),
        Workload("long", "bamba", "8 prompts of 1k-2k tokens, 64 new",
                 uniform_lengths(8, 1024, 2048, 64)),
        Workload("batch1-bamba", "bamba", "batch 1, 64-token prompt, 64 new", batch1, 1),
        Workload("batch1-llama", "llama", "batch 1, 64-token prompt, 64 new", batch1, 1),
        Workload("uniform", "bamba", "32 x 64-token prompts, 64 new", uniform_lengths(32, 64, 64, 64)),
        Workload("skewed", "bamba", "31 x 64 + 1 x 2048-token prompts, 64 new", skewed),
        Workload("burst", "bamba", "32 requests: one 512-token system prompt + 20-60 own, 64 new",
                 burst),
    ]


class _TimedModel:
    """Stands in for the engine's model: times each forward (CPU seconds) and notes its shape."""

    def __init__(self, model, log: list):
        self._model, self._log = model, log

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, batch, caches):
        c0 = time.process_time()
        out = self._model(batch, caches)
        decode_only = all(n == 1 for n in batch.query_lens_cpu)
        self._log.append((time.process_time() - c0, batch.num_reqs, decode_only))
        return out


class Ours:
    """One LLM per workload (built once, warmed up), its steps timed."""

    def __init__(self, path, w: Workload, max_batched: int):
        self.llm = LLM(str(path), memory_budget_bytes=256 << 20, max_num_seqs=w.max_at_once,
                       max_num_batched_tokens=max_batched)
        eng = self.llm.engine
        self.forwards, self.steps = [], []
        eng.runner.model = _TimedModel(eng.runner.model, self.forwards)
        step = eng.step

        def timed_step(*a, **k):
            c0 = time.process_time()
            try:
                return step(*a, **k)
            finally:
                self.steps.append(time.process_time() - c0)

        eng.step = timed_step
        self.llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(max_tokens=2, temperature=0.0),
                          use_tqdm=False)

    def run(self, prompts, max_tokens):
        self.forwards.clear()
        self.steps.clear()
        # EOS suppressed for every token, as transformers' min_new_tokens does on the other side, so
        # the greedy tokens can be compared. Not ignore_eos: like vLLM, min_tokens then no longer
        # holds EOS back (EOS would be picked and generation go on past it)
        params = [SamplingParams(max_tokens=m, min_tokens=m, temperature=0.0)
                  for m in max_tokens]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, cpu, [o.outputs[0].token_ids for o in outs]


class Theirs:
    """transformers' model of the same checkpoint; groups of max_at_once run as padded batches."""

    def __init__(self, path, w: Workload):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.group = w.max_at_once
        self.run([[5, 6, 7, 8, 9, 10, 11, 12]] * 2, [2, 2])  # warm-up: lazy imports, first allocations

    def run(self, prompts, max_tokens):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = []
        with torch.inference_mode():
            for g in range(0, len(prompts), self.group):
                ps, ms = prompts[g:g + self.group], max_tokens[g:g + self.group]
                width = max(map(len, ps))
                ids = torch.zeros(len(ps), width, dtype=torch.long)  # pad id 0, left padding
                mask = torch.zeros(len(ps), width, dtype=torch.long)
                for i, p in enumerate(ps):
                    ids[i, width - len(p):] = torch.tensor(p)
                    mask[i, width - len(p):] = 1
                new = max(ms)
                out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                       do_sample=False, pad_token_id=0)
                tokens += [row[width:width + m].tolist() for row, m in zip(out, ms)]
        return time.perf_counter() - t0, time.process_time() - c0, tokens


def _med(xs):
    return statistics.median(xs), min(xs), max(xs)


def run_workload(w: Workload, path, args) -> dict:
    ours = Ours(path, w, args.max_batched_tokens)
    theirs = None if args.ours_only else Theirs(path, w)
    cpu_r, wall_r, fwd, over, dec, same, ours_cpu, hf_cpu = [], [], [], [], [], 0, [], []
    n_req = n_tok = 0
    for rep in range(args.repeats):
        prompts, max_tokens = w.make(random.Random(1000 * rep + 7), rep)
        order = [s for s in ([ours, theirs] if rep % 2 == 0 else [theirs, ours]) if s is not None]
        res = {id(s): s.run(prompts, max_tokens) for s in order}
        (wo, co, to) = res[id(ours)]
        (wt, ct, tt) = res[id(theirs)] if theirs is not None else (float("nan"),) * 2 + (to,)
        cpu_r.append(ct / co)
        wall_r.append(wt / wo)
        ours_cpu.append(co)
        hf_cpu.append(ct)
        fwd.append(sum(f for f, _, _ in ours.forwards) / len(ours.steps))
        over.append((sum(ours.steps) - sum(f for f, _, _ in ours.forwards)) / len(ours.steps))
        full = max(n for _, n, d in ours.forwards if d) if any(d for *_, d in ours.forwards) else 0
        dec += [f for f, n, d in ours.forwards if d and n == full]
        same = sum(a == b for a, b in zip(to, tt))
        n_req, n_tok = len(prompts), sum(max_tokens)
        print(f"    repeat {rep}: ours {co:.2f} s CPU ({wo:.2f} wall), transformers {ct:.2f} s CPU "
              f"({wt:.2f} wall), {len(ours.steps)} steps", flush=True)
    r = {"workload": w.name, "what": w.what, "requests": n_req, "new_tokens": n_tok,
         "cpu_ratio": _med(cpu_r), "wall_ratio": _med(wall_r), "ours_cpu_s": _med(ours_cpu),
         "hf_cpu_s": _med(hf_cpu), "forward_ms_per_step": 1e3 * statistics.median(fwd),
         "overhead_ms_per_step": 1e3 * statistics.median(over),
         "decode_step_forward_ms": _med([1e3 * x for x in dec]) if dec else None,
         "same_greedy": same}
    c, wl = r["cpu_ratio"], r["wall_ratio"]
    print(f"  {w.name}: transformers/ours CPU {c[0]:.2f}x ({c[1]:.2f}-{c[2]:.2f}), wall {wl[0]:.2f}x "
          f"({wl[1]:.2f}-{wl[2]:.2f}); per step: forward {r['forward_ms_per_step']:.2f} ms, engine "
          f"{r['overhead_ms_per_step']:.2f} ms; greedy identical on {same}/{n_req}", flush=True)
    if dec:
        d = r["decode_step_forward_ms"]
        print(f"    decode-only step forward (full batch): {d[0]:.2f} ms ({d[1]:.2f}-{d[2]:.2f})")
    return r


def part_workloads(args) -> list[dict]:
    only = set(args.only.split(",")) if args.only else None
    chosen = [w for w in workloads(args.quick) if only is None or w.name in only]
    results = []
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for w in chosen:
            if w.family not in paths:
                cfg = dict(CONFIGS[w.family], **(QUICK if args.quick else {}))
                if args.quick and w.family == "bamba":
                    cfg["attn_layer_indices"] = [1, 3]
                paths[w.family] = make_tiny_checkpoint(w.family, f"{d}/{w.family}", **cfg)
            print(f"workload {w.name} ({w.family}): {w.what}", flush=True)
            results.append(run_workload(w, paths[w.family], args))
    by = {r["workload"]: r for r in results}
    if "skewed" in by and "uniform" in by and by["uniform"]["decode_step_forward_ms"]:
        ratio = by["skewed"]["decode_step_forward_ms"][0] / by["uniform"]["decode_step_forward_ms"][0]
        print(f"skewed / uniform decode-step forward: {ratio:.2f}x (goal <= 1.5x)")
    return results


@contextmanager
def _timed(obj, name: str, acc: list):
    """Wrap obj.name so each call adds its seconds to acc[0]."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        if getattr(_timed, "busy", None) is acc:  # inside another timed call of this acc: counted there
            return fn(*a, **k)
        _timed.busy, t0 = acc, time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _timed.busy = None
            acc[0] += time.perf_counter() - t0

    own = vars(obj).get(name)  # a class's own function (restored), or None (an instance: its class's)
    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        if own is not None:
            setattr(obj, name, own)
        else:
            delattr(obj, name)


class _StubModel:
    """Stands in for the model in part 2: zero logits [R, vocab], no forward pass."""

    def __init__(self, model):
        self.vocab_size, self.device = model.vocab_size, model.device

    def __call__(self, batch, caches):
        return torch.zeros(batch.num_reqs, self.vocab_size)


def part_overhead(args) -> dict:
    num_reqs, steps = (32, 10) if args.quick else (256, 50)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint("bamba", d)  # the 4-layer tiny config: the model never runs
        llm = LLM(str(path), memory_budget_bytes=256 << 20, max_num_seqs=num_reqs,
                  max_num_batched_tokens=8192)
    eng = llm.engine
    eng.runner.model = _StubModel(llm.model)
    params = SamplingParams(max_tokens=10_000 if not args.quick else 100, temperature=0.0, ignore_eos=True)
    rng = random.Random(1)
    for _ in range(num_reqs):
        llm.add_request(_toks(rng, rng.randint(16, 200), llm.model.vocab_size), params)
    while any(eng.mgr.request(r.request_id).num_computed_tokens < len(r.prompt_token_ids)
              for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill everyone
    assert len(eng.scheduler.running) == num_reqs
    sched, batch, mgr, whole = [], [], [], []
    for _ in range(steps):
        acc_s, acc_b, acc_m = [0.0], [0.0], [0.0]
        with _timed(eng.scheduler, "schedule", acc_s), _timed(eng.runner.batch_builder, "build", acc_b), \
                _timed(eng.mgr, "commit", acc_m), _timed(eng.mgr.prefix_cache, "checkpoint", acc_m), \
                _timed(DecodeRows, "commit", acc_m):
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
    ap.add_argument("--part", choices=["all", "workloads", "overhead", "throughput"], default="all",
                    help="throughput: the Bamba workload alone (the earlier sessions' command)")
    ap.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    ap.add_argument("--repeats", type=int, default=5, help="alternating repeats; medians are printed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both systems")
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--ours-only", action="store_true",
                    help="skip transformers (step-time figures only, e.g. skewed vs uniform)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.part == "throughput":
        args.part, args.only = "workloads", args.only or "bamba"
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    os.environ[ENV_VAR] = str(args.threads)  # LLM sets its threads from it (hybridkv/cpu_threads.py)
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} "
          f"torch threads, torch {torch.__version__}, python {platform.python_version()}, "
          f"{args.repeats} repeats")
    out = {}
    if args.part in ("all", "workloads"):
        out["workloads"] = part_workloads(args)
    if args.part in ("all", "overhead"):
        out["overhead"] = part_overhead(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
