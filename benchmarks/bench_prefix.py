"""Prefix-cache policies for a hybrid model on synthetic traces, through the real scheduler and
memory manager with no model (benchmarks/replay.py): token hit rate, checkpoint memory and the
prefill FLOPs saved, against the checkpoint memory budget.

    python benchmarks/bench_prefix.py --out bench_prefix_out          # about a minute on 2 CPU cores
    python benchmarks/bench_prefix.py --small --out /tmp/bp           # what CI runs

Policies (block size 16 unless named): none, prompt_end, every_n_blocks (n = 1 and 4),
branch_points, and align528: an emulation of vLLM's hybrid "align" prefix caching, where the
attention page is stretched to the Mamba state's page (528 tokens for many hybrids) and a state
is kept only at a page boundary (block_size 528, policy prompt_end). Memory is reported for
Bamba-9B (examples/configs/bamba-9b.json): one state checkpoint is one Bamba-9B state slot.
The KV pool is large enough that no trace evicts KV blocks: only checkpoint memory is scarce.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # traces.py, replay.py beside this file

from hybridkv.cache_manager import HybridCacheManager  # noqa: E402
from hybridkv.config_specs import load_config, specs_from_config  # noqa: E402
from hybridkv.plan import split_specs, state_bytes_per_slot  # noqa: E402
from hybridkv.specs import AttentionSpec, RecurrentSpec  # noqa: E402
from replay import replay  # noqa: E402
from traces import agent_sessions, few_shot, short_prefixes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIG = ROOT / "examples" / "configs" / "bamba-9b.json"
# name -> (block_size, checkpoint_policy, every_n)
POLICIES = {
    "none": (16, "none", 4),
    "prompt_end": (16, "prompt_end", 4),
    "every_1_blocks": (16, "every_n_blocks", 1),
    "every_4_blocks": (16, "every_n_blocks", 4),
    "branch_points": (16, "branch_points", 4),
    "align528": (528, "prompt_end", 4),
}
# Tiny stand-in tensors: the replay never reads KV or state values, only ids and counts.
STAND_IN = {0: AttentionSpec(1, 4, torch.float16), 1: RecurrentSpec((2, 3), (2, 2), torch.float16)}
KV_TOKENS = 400_000


def non_embedding_params(cfg: dict) -> int:
    """Parameters outside the embedding and LM head, counted on transformers' own model built on
    the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("model_type", "torch_dtype")}
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)


def flops_saved_fn(cfg: dict, n_params: int):
    """h -> prefill FLOPs not spent when a prompt's first h tokens come from the cache:
    2 x params x h for the matmuls, plus causal attention's 2 x heads x head_dim x h^2 per layer."""
    attn = split_specs(specs_from_config(cfg))[0]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    quad = 2.0 * len(attn) * cfg["num_attention_heads"] * head_dim
    return lambda h: 2.0 * n_params * h + quad * h * h


def make_manager(policy: str, checkpoint_slots: int, max_num_seqs: int) -> HybridCacheManager:
    bs, name, n = POLICIES[policy]
    return HybridCacheManager(STAND_IN, bs, KV_TOKENS // bs, 1 + max_num_seqs + checkpoint_slots,
                              checkpoint_policy=name, checkpoint_every_n=n, fingerprint="bench_prefix")


def traces(small: bool) -> dict:
    if small:
        return {"agent": agent_sessions(num_sessions=8, turns=3),
                "few_shot": few_shot(num_tasks=3, queries_per_task=4),
                "short_prefix": short_prefixes(num_prefixes=4, requests_per_prefix=4)}
    return {"agent": agent_sessions(), "few_shot": few_shot(), "short_prefix": short_prefixes()}


def run(small: bool = False, budgets=None, max_num_seqs: int = 4) -> dict:
    """All policies x checkpoint budgets (slots) x traces. Returns the JSON-able report."""
    cfg = load_config(MODEL_CONFIG)
    slot_bytes = state_bytes_per_slot(specs_from_config(cfg))
    saved = flops_saved_fn(cfg, non_embedding_params(cfg))
    budgets = budgets or ([2, 16] if small else [1, 2, 4, 8, 16, 32, 64])
    rows = []
    for trace_name, trace in traces(small).items():
        total_flops = sum(saved(len(t.prompt)) for t in trace)
        for policy in POLICIES:
            for slots in budgets:
                t0 = time.perf_counter()
                res = replay(make_manager(policy, slots, max_num_seqs), trace, max_num_seqs=max_num_seqs)
                flops = sum(saved(h) for _, h in res.hits)
                rows.append({
                    "trace": trace_name, "policy": policy, "checkpoint_slots": slots,
                    "checkpoint_gib": slots * slot_bytes / 2**30, "hit_rate": res.hit_rate,
                    "hit_tokens": res.hit_tokens, "prompt_tokens": res.prompt_tokens,
                    "requests_hit": sum(1 for _, h in res.hits if h > 0), "requests": len(res.hits),
                    "short_hits": sum(1 for _, h in res.hits if 0 < h < 528),
                    "peak_checkpoints": res.peak_checkpoints,
                    "peak_checkpoint_gib": res.peak_checkpoints * slot_bytes / 2**30,
                    "prefill_pflops_saved": flops / 1e15, "prefill_flops_saved_share": flops / total_flops,
                    "steps": res.steps, "seconds": time.perf_counter() - t0})
    return {"model": cfg["_source"], "state_bytes_per_slot": slot_bytes, "max_num_seqs": max_num_seqs,
            "kv_tokens": KV_TOKENS, "budgets": budgets, "rows": rows}


def markdown(report: dict, at_slots: int) -> str:
    head = ("| trace | policy | ckpt slots (GiB) | token hit rate | requests hit | hits < 528 tokens "
            "| peak ckpts (GiB) | prefill FLOPs saved |\n|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['trace']} | {r['policy']} | {r['checkpoint_slots']} ({r['checkpoint_gib']:.2f}) "
             f"| {r['hit_rate']:.1%} | {r['requests_hit']}/{r['requests']} | {r['short_hits']} "
             f"| {r['peak_checkpoints']} ({r['peak_checkpoint_gib']:.2f}) "
             f"| {r['prefill_pflops_saved']:.2f} PFLOP ({r['prefill_flops_saved_share']:.1%}) |"
             for r in report["rows"] if r["checkpoint_slots"] == at_slots]
    return head + "\n".join(lines) + "\n"


def sweep_markdown(report: dict) -> str:
    """Token hit rate per trace and policy (rows) at every checkpoint budget (columns)."""
    b = report["budgets"]
    rate = {(r["trace"], r["policy"], r["checkpoint_slots"]): r["hit_rate"] for r in report["rows"]}
    traces_ = list(dict.fromkeys(r["trace"] for r in report["rows"]))
    head = ("| trace | policy | " + " | ".join(f"{s} slots" for s in b) + " |\n|---|---|"
            + "---|" * len(b) + "\n")
    return head + "\n".join(f"| {t} | {p} | " + " | ".join(f"{rate[(t, p, s)]:.0%}" for s in b) + " |"
                             for t in traces_ for p in POLICIES) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["trace"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True)
    for ax, trace in zip(axes, names):
        for policy in POLICIES:
            pts = [(r["checkpoint_gib"], r["hit_rate"] * 100) for r in report["rows"]
                   if r["trace"] == trace and r["policy"] == policy]
            ax.plot(*zip(*pts), marker="o", label=policy)
        ax.set_xscale("log", base=2)
        xs = sorted({r["checkpoint_gib"] for r in report["rows"]})
        ax.set_xticks(xs, [f"{x:.2g}" for x in xs])
        ax.minorticks_off()
        ax.set_title(f"{trace} trace")
        ax.set_xlabel("checkpoint memory budget (GiB, Bamba-9B state slots)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("prefix token hit rate (%)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_prefix_out", help="folder for results.md, results.json, hit_rate.png")
    ap.add_argument("--small", action="store_true", help="small traces and budgets (CI)")
    ap.add_argument("--table-slots", type=int, default=None, help="checkpoint slots of the printed table")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = run(a.small)
    report["seconds"] = time.perf_counter() - t0
    report["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}"
    at = a.table_slots or (8 if a.small else 16)
    table = markdown(report, at)
    gib = report["state_bytes_per_slot"] / 2**30
    (out / "results.md").write_text(
        f"Checkpoint budget {at} slots; {report['machine']}; {report['seconds']:.0f} s\n\n" + table
        + f"\nToken hit rate against the checkpoint budget (one slot = {gib:.3f} GiB):\n\n"
        + sweep_markdown(report))
    (out / "results.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "hit_rate.png")
    print(table)
    print(sweep_markdown(report))
    print(f"wrote {out}/results.md, results.json, hit_rate.png in {report['seconds']:.1f} s")
    return report


if __name__ == "__main__":
    main()
