"""What a hybrid model buys over a pure-attention one, and what paging buys over contiguous
pre-allocation, at one fixed memory budget.

    python examples/compare_baseline.py --out compare_out            # about 2 minutes on 2 CPU cores
    python examples/compare_baseline.py --small --out /tmp/cmp       # CI size

1. Planner, published configs (examples/configs/*.json, no weights): bytes per request against
   context length and the most concurrent requests a budget holds (`--config`, `--baseline-config`,
   `--budget-gib`); and how many fit at 32k tokens with KV and state kept in int8 / fp8_e4m3.
2. Real runs on CPU: a tiny Bamba (Mamba2 + attention) and a tiny Llama of matched size (same hidden
   size, layer count and heads; attention in every layer), random weights, one budget, one
   workload (a shared system prompt plus distinct questions), each served twice through `LLM`:
   paged (block 16, prefix caching) and contiguous (one max_model_len reservation per request).
   Per engine step: running requests, KV+state bytes in use, tokens held / tokens reserved.

Writes results.md, results.json, memory_per_request.png, concurrency.png, throughput.png and
utilization.png into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # compare_plots.py beside this file

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.config_specs import load_specs  # noqa: E402
from hybridkv.contiguous import (bytes_per_request, contiguous_llm_kwargs, max_concurrent_requests,  # noqa: E402
                                 pool_utilization)
from hybridkv.models.tiny import make_tiny_checkpoint  # noqa: E402
from hybridkv.plan import kv_bytes_per_block, kv_bytes_per_token, state_bytes_per_slot  # noqa: E402
from hybridkv.specs import with_cache_dtypes  # noqa: E402

import compare_plots  # noqa: E402

CONFIGS = HERE / "configs"
MiB = 1 << 20
CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


# ---- 1. planner ---------------------------------------------------------------------------------
def planner(config_paths: list[Path], budget_bytes: int, block_size: int = 16) -> dict:
    """Per config: KV bytes per token, state bytes per request, and per context length the bytes
    one request holds and how many fit in `budget_bytes` (paged, block_size tokens per block)."""
    out = {}
    for path in config_paths:
        specs = load_specs(path)
        quant = {name: with_cache_dtypes(specs, name, name) for name in ("int8", "fp8_e4m3")}
        out[path.stem] = {
            "kv_bytes_per_token": kv_bytes_per_token(specs), "state_bytes": state_bytes_per_slot(specs),
            "bytes_per_request": {c: bytes_per_request(specs, c, block_size) for c in CONTEXTS},
            "max_concurrent": {c: max_concurrent_requests(specs, budget_bytes, c, block_size) for c in CONTEXTS},
            # KV and state kept in one byte a value plus scales (kv_cache_dtype = state_cache_dtype)
            "quantized": {name: {"kv_bytes_per_token": kv_bytes_per_token(q), "state_bytes": state_bytes_per_slot(q),
                                 "max_concurrent_32k": max_concurrent_requests(q, budget_bytes, 32768, block_size)}
                          for name, q in quant.items()}}
    return out


# ---- 2. real runs -------------------------------------------------------------------------------
def tiny_pair(root: Path, layers: int, max_len: int) -> dict[str, Path]:
    """A tiny Bamba (attention at every other layer) and a Llama with the same hidden size (64),
    layers, heads (4) and KV heads (2), head_dim 16, MLP 128: attention in every layer."""
    common = dict(num_hidden_layers=layers, max_position_embeddings=max_len)
    return {
        "hybrid (Bamba)": make_tiny_checkpoint("bamba", root / "bamba", attn_layer_indices=list(range(1, layers, 2)),
                                               **common),
        "attention (Llama)": make_tiny_checkpoint("llama", root / "llama", **common)}


def workload(n: int, system_len: int, question: tuple[int, int], answer: tuple[int, int],
             seed: int = 0) -> list[tuple[list[int], int]]:
    """n requests: one shared system prompt + a distinct question; (token ids, max_tokens) each."""
    rng = random.Random(seed)
    system = [rng.randrange(4, 128) for _ in range(system_len)]
    return [(system + [rng.randrange(4, 128) for _ in range(rng.randint(*question))], rng.randint(*answer))
            for _ in range(n)]


def serve(path: Path, work, budget: int, max_len: int, mode: str, max_num_seqs: int,
          checkpoint_policy: str = "branch_points") -> dict:
    """Run `work` through LLM in `mode` ('paged' | 'contiguous'); per-step samples and totals.
    Paged runs use prefix caching with `checkpoint_policy` (ignored by pure-attention models)."""
    kw = contiguous_llm_kwargs(max_len) if mode == "contiguous" else dict(
        block_size=16, max_model_len=max_len, checkpoint_policy=checkpoint_policy)
    llm = LLM(str(path), dtype="float32", memory_budget_bytes=budget, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=512, preemption_mode="recompute", **kw)
    mgr = llm.manager
    block_bytes = kv_bytes_per_block(mgr.specs, mgr.block_size)
    slot_bytes = state_bytes_per_slot(mgr.specs)
    for ids, max_tokens in work:
        llm.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    running, in_use, util = [], [], []
    t0 = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
        s = mgr.stats()
        held, reserved = pool_utilization(mgr)
        running.append(s.running_requests)
        in_use.append(s.kv_blocks_used * block_bytes + (s.slots_live + s.slots_checkpoint) * slot_bytes)
        util.append(held / reserved if reserved else None)
    wall = time.perf_counter() - t0
    st = llm.stats()
    prompt_tokens = sum(len(ids) for ids, _ in work)
    used = [u for u in util if u is not None]
    return {
        "mode": mode, "block_size": mgr.block_size, "kv_blocks": mgr.num_blocks,
        "state_slots": max(0, mgr.num_slots - 1), "pool_bytes": mgr.num_blocks * block_bytes + mgr.num_slots * slot_bytes,
        "running": running, "in_use_bytes": in_use, "utilization": util,
        "mean_running": sum(running) / len(running), "max_running": max(running),
        "mean_utilization": sum(used) / len(used) if used else 0.0,
        "peak_in_use_bytes": max(in_use), "steps": st["steps"], "wall_seconds": wall,
        "tokens_per_second": (prompt_tokens + st["generated_tokens"]) / wall,
        "generated_tokens_per_second": st["generated_tokens"] / wall,
        "prefix_hit_rate": st["prefix_hit_rate"], "preemptions": sum(st["preemptions"].values())}


def real_runs(small: bool, workdir: Path, checkpoint_policy: str = "branch_points") -> dict:
    layers, max_len = 4, 256
    n, system_len, question, answer = (8, 32, (8, 96), (4, 12)) if small else (24, 48, (16, 160), (8, 32))
    budget = 1 * MiB
    models = tiny_pair(workdir, layers, max_len)
    work = workload(n, system_len, question, answer)
    runs = {}
    for name, path in models.items():
        for mode in ("paged", "contiguous"):
            runs[f"{name}, {mode}"] = serve(path, work, budget, max_len, mode, 12, checkpoint_policy)
            print(f"  ran {name}, {mode}: {runs[f'{name}, {mode}']['steps']} steps", flush=True)
    specs = {name: load_specs(path / "config.json", None) for name, path in models.items()}
    per_req = {name: {c: bytes_per_request(s, c) for c in (max_len, 4096)} for name, s in specs.items()}
    return {"budget_bytes": budget, "max_model_len": max_len, "requests": n, "layers": layers,
            "checkpoint_policy": checkpoint_policy,
            "prompt_tokens": sum(len(i) for i, _ in work), "bytes_per_request": per_req, "runs": runs}


# ---- report -------------------------------------------------------------------------------------
def markdown(plan: dict, budget_gib: float, real: dict) -> str:
    lines = [f"### Planner: published configs, paged (block 16), budget {budget_gib:g} GiB", "",
             "| config | KV / token | state / request | bytes / request at 4k | at 32k | max concurrent at 4k | at 32k |",
             "|---|---|---|---|---|---|---|"]
    for name, p in plan.items():
        b, c = p["bytes_per_request"], p["max_concurrent"]
        lines.append(f"| {name} | {p['kv_bytes_per_token'] / 1024:.0f} KiB | {p['state_bytes'] / MiB:.1f} MiB "
                     f"| {b[4096] / MiB:.0f} MiB | {b[32768] / MiB:.0f} MiB | {c[4096]} | {c[32768]} |")
    lines += ["", f"### Quantized caches (kv_cache_dtype = state_cache_dtype): requests that fit at 32k tokens, "
              f"budget {budget_gib:g} GiB", "",
              "| config | config dtype: state / request | int8: state / request | requests at 32k | int8 | ratio "
              "| fp8_e4m3 | ratio |", "|---|---|---|---|---|---|---|---|"]
    for name, p in plan.items():
        base, q8, f8 = p["max_concurrent"][32768], p["quantized"]["int8"], p["quantized"]["fp8_e4m3"]
        lines.append(f"| {name} | {p['state_bytes'] / MiB:.1f} MiB | {q8['state_bytes'] / MiB:.1f} MiB | {base} "
                     f"| {q8['max_concurrent_32k']} | {q8['max_concurrent_32k'] / max(base, 1):.2f}x "
                     f"| {f8['max_concurrent_32k']} | {f8['max_concurrent_32k'] / max(base, 1):.2f}x |")
    lines += ["", f"### Real runs on CPU: tiny models, {real['layers']} layers, budget {real['budget_bytes'] // 1024} KiB, "
              f"{real['requests']} requests ({real['prompt_tokens']} prompt tokens), max_model_len {real['max_model_len']}, "
              f"max_num_seqs 12, hybrid checkpoint policy {real['checkpoint_policy']}", "",
              "| model, mode | KV blocks x tokens | state slots | running mean / max | utilization (held / reserved) "
              "| peak KV+state in use | tokens/s | generated tok/s | prefix hit rate | preemptions | steps |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in real["runs"].items():
        lines.append(f"| {name} | {r['kv_blocks']} x {r['block_size']} | {r['state_slots']} "
                     f"| {r['mean_running']:.1f} / {r['max_running']} | {r['mean_utilization']:.1%} "
                     f"| {r['peak_in_use_bytes'] / 1024:.0f} KiB | {r['tokens_per_second']:.0f} "
                     f"| {r['generated_tokens_per_second']:.1f} | {r['prefix_hit_rate']:.1%} | {r['preemptions']} "
                     f"| {r['steps']} |")
    lines += ["", "Bytes per request of the tiny models: " + "; ".join(
        f"{name}: {b[4096] / 1024:.0f} KiB at 4096 tokens" for name, b in real["bytes_per_request"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="compare_out", help="folder for the table, JSON and PNGs")
    ap.add_argument("--small", action="store_true", help="fewer, shorter requests (CI)")
    ap.add_argument("--config", action="append", type=Path,
                    help="published config JSON for the planner (repeatable; default: all in examples/configs)")
    ap.add_argument("--baseline-config", type=Path, default=CONFIGS / "llama-3-8b.json",
                    help="the pure-attention config drawn as the baseline")
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV+state budget of the planner (GiB)")
    ap.add_argument("--checkpoint-policy", default="branch_points",
                    help="the hybrid's state checkpoint policy in the paged runs")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = a.config or sorted(CONFIGS.glob("*.json"))
    if a.baseline_config not in paths:
        paths.append(a.baseline_config)
    t0 = time.perf_counter()
    plan = planner(paths, int(a.budget_gib * 2**30))
    with tempfile.TemporaryDirectory() as tmp:
        real = real_runs(a.small, Path(tmp), a.checkpoint_policy)
    report = {"planner": plan, "budget_gib": a.budget_gib, "baseline": a.baseline_config.stem, "real": real,
              "seconds": time.perf_counter() - t0,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}"}
    table = markdown(plan, a.budget_gib, real)
    (out / "results.md").write_text(table + f"\n{report['machine']}; {report['seconds']:.0f} s\n")
    (out / "results.json").write_text(json.dumps(report, indent=1))
    compare_plots.write_all(report, out)
    print(table)
    print(f"wrote {out}: results.md, results.json, memory_per_request.png, concurrency.png, throughput.png, "
          f"utilization.png ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
