"""Prefix-cache policies for a hybrid model on synthetic traces, through the real scheduler and
memory manager with no model (benchmarks/replay.py): token hit rate, its share of the
attention-only ceiling, checkpoint memory and the prefill FLOPs saved, against the checkpoint
memory budget; and the burst figure (prefill tokens a cold shared prompt costs).

    python benchmarks/bench_prefix.py --out bench_prefix_out          # a few minutes on 2 CPU cores
    python benchmarks/bench_prefix.py --small --out /tmp/bp           # what the test runs
    python benchmarks/bench_prefix.py --tiers-only --out bench_tiers  # the memory-tier table alone

Traces (benchmarks/traces.py): agent, few_shot, short_prefix (shared prefixes < 528 tokens),
burst (32 requests sharing a cold 512-token system prompt, all arriving at once) and chat
(multi-tenant multi-turn chats, two tenants salted). At most 4 requests run at once; at most 4
sessions are open at once, except in the burst, where every request has arrived before the
first step.

Policies (block size 16 unless named): none, prompt_end, every_n_blocks (n = 1 and 4),
branch_points, junctions (DEFAULT_POLICY), and align528: an emulation of vLLM's hybrid "align"
prefix caching, where the attention page is stretched to the Mamba state's page (528 tokens for
many hybrids) and a state is kept only at a page boundary (block_size 528, policy prompt_end,
LRU eviction as vLLM's block pool). Every other policy evicts checkpoints by the library's default
rule (hybridkv.eviction.DEFAULT_EVICTION); the default policy is also run with 'lru' and 'flop'.

Attention-only ceiling: the same trace replayed with the same scheduler settings on a manager
whose only layer is attention (same KV pool, block size 16): every cached full block is usable,
as if every state at every block boundary were kept for free. It is what the KV blocks alone give;
"% of ceiling" = a policy's token hit rate / the ceiling's. (A hybrid can pass 100%: the burst
rule holds followers for a leader on both, but timing differs when chunks are cut.)

Memory is reported for Bamba-9B (examples/configs/bamba-9b.json): one state checkpoint is one
Bamba-9B state slot. The KV pool is large enough that no trace evicts KV blocks: only checkpoint
memory is scarce. "prefill chunks" counts the chunks that compute prompt tokens: every checkpoint
cut inside a prompt adds one step to that request's prefill (the replay does not charge it).

Memory tiers (issue 26): the default policy at 2 and 4 device checkpoint slots, with and without
a host tier of `--host-x` (default 8) times the device checkpoint bytes (memory/host_tier.py),
beside the ceiling (with a host tier, `junctions` also leaves a trail of states in each fresh
prompt: checkpoint_policy.HOST_TIER_TRAIL; each adds a prefill chunk, counted); and the ceiling again with 4x the KV pool, which is equal when no trace is
limited by KV eviction.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # traces.py, replay.py beside this file

from hybridkv.cache_manager import HybridCacheManager  # noqa: E402
from hybridkv.checkpoint_policy import DEFAULT_POLICY  # noqa: E402
from hybridkv.config_specs import load_config, specs_from_config  # noqa: E402
from hybridkv.eviction import DEFAULT_EVICTION  # noqa: E402
from hybridkv.plan import split_specs, state_bytes_per_slot  # noqa: E402
from hybridkv.specs import AttentionSpec, RecurrentSpec  # noqa: E402
from replay import replay  # noqa: E402
from traces import agent_sessions, burst, few_shot, multi_tenant_chat, short_prefixes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIG = ROOT / "examples" / "configs" / "bamba-9b.json"
# name -> (block_size, checkpoint_policy, every_n, checkpoint_eviction)
POLICIES = {
    "none": (16, "none", 4, DEFAULT_EVICTION),
    "prompt_end": (16, "prompt_end", 4, DEFAULT_EVICTION),
    "every_1_blocks": (16, "every_n_blocks", 1, DEFAULT_EVICTION),
    "every_4_blocks": (16, "every_n_blocks", 4, DEFAULT_EVICTION),
    "branch_points": (16, "branch_points", 4, DEFAULT_EVICTION),
    DEFAULT_POLICY: (16, DEFAULT_POLICY, 4, DEFAULT_EVICTION),
    "align528": (528, "prompt_end", 4, "lru"),
}
# the default policy under the other eviction rules (rows of the sweep, not rivals of the default)
EVICTION_VARIANTS = {f"{DEFAULT_POLICY}+{e}": (16, DEFAULT_POLICY, 4, e) for e in ("lru", "flop")
                     if e != DEFAULT_EVICTION}
# Tiny stand-in tensors: the replay never reads KV or state values, only ids and counts.
STAND_IN = {0: AttentionSpec(1, 4, torch.float16), 1: RecurrentSpec((2, 3), (2, 2), torch.float16)}
KV_TOKENS = 400_000
MAX_NUM_SEQS = 4


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


def make_manager(policy: str, checkpoint_slots: int, max_num_seqs: int = MAX_NUM_SEQS,
                 host_entries: int = 0) -> HybridCacheManager:
    """A hybrid manager for `policy` (a key of POLICIES or EVICTION_VARIANTS): 1 null + one live
    slot per running request + `checkpoint_slots` state slots, and a host tier holding
    `host_entries` states (0: none)."""
    bs, name, n, eviction = {**POLICIES, **EVICTION_VARIANTS}[policy]
    return HybridCacheManager(STAND_IN, bs, KV_TOKENS // bs, 1 + max_num_seqs + checkpoint_slots,
                              checkpoint_policy=name, checkpoint_every_n=n, checkpoint_eviction=eviction,
                              fingerprint="bench_prefix",
                              host_cache_bytes=host_entries * state_bytes_per_slot(STAND_IN))


def ceiling_manager(kv_tokens: int = KV_TOKENS) -> HybridCacheManager:
    """The attention-only ceiling: the same KV pool and block size, no recurrent layer."""
    return HybridCacheManager({0: STAND_IN[0]}, 16, kv_tokens // 16, 0, fingerprint="bench_prefix")


def traces(small: bool, seed: Optional[int] = None) -> dict:
    """name -> (trace, max_active): how many sessions are open at once (the burst: all of it).
    seed: every trace drawn with this seed instead of its own (the tier table's robustness runs)."""
    s = {} if seed is None else {"seed": seed}
    if small:
        out = (20, 60)  # shorter answers (decode steps are most of the replay time), each past a block
        return {"agent": (agent_sessions(num_sessions=6, turns=3, output_len=out, **s), MAX_NUM_SEQS),
                "few_shot": (few_shot(num_tasks=3, queries_per_task=5, output_len=out, **s), MAX_NUM_SEQS),
                "short_prefix": (short_prefixes(num_prefixes=4, requests_per_prefix=5, output_len=out, **s),
                                 MAX_NUM_SEQS),
                "burst": (burst(num_requests=12, output_len=out, **s), 12),
                "chat": (multi_tenant_chat(chats_per_tenant=2, turns=4, output_len=out, **s), MAX_NUM_SEQS)}
    return {"agent": (agent_sessions(**s), MAX_NUM_SEQS), "few_shot": (few_shot(**s), MAX_NUM_SEQS),
            "short_prefix": (short_prefixes(**s), MAX_NUM_SEQS), "burst": (burst(**s), 32),
            "chat": (multi_tenant_chat(**s), MAX_NUM_SEQS)}


def run(small: bool = False, budgets=None, max_num_seqs: int = MAX_NUM_SEQS) -> dict:
    """All policies (and the default's eviction variants) x checkpoint budgets (slots) x traces,
    plus each trace's attention-only ceiling. Returns the JSON-able report."""
    cfg = load_config(MODEL_CONFIG)
    slot_bytes = state_bytes_per_slot(specs_from_config(cfg))
    saved = flops_saved_fn(cfg, non_embedding_params(cfg))
    budgets = budgets or [2, 4, 8, 16, 32]
    rows, ceilings = [], {}
    for trace_name, (trace, max_active) in traces(small).items():
        total_flops = sum(saved(len(t.prompt)) for t in trace)
        ceil = replay(ceiling_manager(), trace, max_num_seqs=max_num_seqs, max_active=max_active)
        ceilings[trace_name] = {"hit_rate": ceil.hit_rate, "hit_tokens": ceil.hit_tokens,
                                "prompt_tokens": ceil.prompt_tokens, "prefill_chunks": ceil.prefill_chunks}
        for policy in {**POLICIES, **({} if small else EVICTION_VARIANTS)}:
            for slots in budgets:
                t0 = time.perf_counter()
                res = replay(make_manager(policy, slots, max_num_seqs), trace, max_num_seqs=max_num_seqs,
                             max_active=max_active)
                flops = sum(saved(h) for _, h in res.hits)
                rows.append({
                    "trace": trace_name, "policy": policy, "checkpoint_slots": slots,
                    "checkpoint_gib": slots * slot_bytes / 2**30, "hit_rate": res.hit_rate,
                    "of_ceiling": res.hit_rate / ceil.hit_rate if ceil.hit_rate else 0.0,
                    "hit_tokens": res.hit_tokens, "prompt_tokens": res.prompt_tokens,
                    "prefill_tokens": res.prompt_tokens - res.hit_tokens, "prefill_chunks": res.prefill_chunks,
                    "requests_hit": sum(1 for _, h in res.hits if h > 0), "requests": len(res.hits),
                    "short_hits": sum(1 for _, h in res.hits if 0 < h < 528),
                    "peak_checkpoints": res.peak_checkpoints,
                    "peak_checkpoint_gib": res.peak_checkpoints * slot_bytes / 2**30,
                    "prefill_pflops_saved": flops / 1e15, "prefill_flops_saved_share": flops / total_flops,
                    "steps": res.steps, "seconds": time.perf_counter() - t0})
    return {"model": cfg["_source"], "state_bytes_per_slot": slot_bytes, "max_num_seqs": max_num_seqs,
            "kv_tokens": KV_TOKENS, "budgets": budgets, "default_policy": DEFAULT_POLICY,
            "default_eviction": DEFAULT_EVICTION, "ceilings": ceilings, "rows": rows}


def run_tiers(small: bool = False, budgets=(2, 4), host_x: int = 8, max_num_seqs: int = MAX_NUM_SEQS,
              seed: Optional[int] = None) -> dict:
    """The default policy at each device checkpoint budget, one tier and with a host tier of
    host_x times the device checkpoint bytes, per trace, as shares of the attention-only ceiling
    (and of the ceiling with 4x the KV pool). seed: the traces drawn with it (traces())."""
    rows = []
    for trace_name, (trace, max_active) in traces(small, seed).items():
        ceil = replay(ceiling_manager(), trace, max_num_seqs=max_num_seqs, max_active=max_active)
        big = replay(ceiling_manager(4 * KV_TOKENS), trace, max_num_seqs=max_num_seqs, max_active=max_active)
        for slots in budgets:
            one = replay(make_manager(DEFAULT_POLICY, slots, max_num_seqs), trace, max_num_seqs=max_num_seqs,
                         max_active=max_active)
            mgr = make_manager(DEFAULT_POLICY, slots, max_num_seqs, host_entries=host_x * slots)
            two = replay(mgr, trace, max_num_seqs=max_num_seqs, max_active=max_active)
            host = mgr.stats().tiers["host"]
            rows.append({"trace": trace_name, "checkpoint_slots": slots, "host_entries": host_x * slots,
                         "ceiling": ceil.hit_rate, "ceiling_4x_kv": big.hit_rate,
                         "one_tier": one.hit_rate, "host_tier": two.hit_rate,
                         "one_tier_of_ceiling": one.hit_rate / ceil.hit_rate if ceil.hit_rate else 0.0,
                         "host_tier_of_ceiling": two.hit_rate / ceil.hit_rate if ceil.hit_rate else 0.0,
                         "prefill_chunks": {"ceiling": ceil.prefill_chunks, "one_tier": one.prefill_chunks,
                                            "host_tier": two.prefill_chunks},
                         "host": host, "device": mgr.stats().tiers["device"]})
    return {"host_x": host_x, "budgets": list(budgets), "rows": rows}


def tiers_markdown(report: dict) -> str:
    x = report["host_x"]
    head = (f"| trace | device ckpt slots | ceiling (4x KV) | one tier: hit rate (% of ceiling) | + host tier "
            f"{x}x: hit rate (% of ceiling) | host hits | demotions (refused) | host evictions "
            "| prefill chunks (ceiling / one tier / host tier) |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['trace']} | {r['checkpoint_slots']} | {r['ceiling']:.1%} ({r['ceiling_4x_kv']:.1%}) "
             f"| {r['one_tier']:.1%} ({r['one_tier_of_ceiling']:.0%}) | {r['host_tier']:.1%} "
             f"(**{r['host_tier_of_ceiling']:.1%}**) | {r['host']['hits']} | {r['host']['demotions']} "
             f"({r['host']['refused_demotions']}) | {r['host']['evictions']} "
             f"| {r['prefill_chunks']['ceiling']} / {r['prefill_chunks']['one_tier']} / {r['prefill_chunks']['host_tier']} |"
             for r in report["rows"]]
    return head + "\n".join(lines) + "\n"


def seeds_markdown(by_seed: dict) -> str:
    """The host tier's share of the ceiling per trace and device budget (rows) for each trace seed
    (columns), with the minimum and mean."""
    seeds = list(by_seed)
    share = {(seed, r["trace"], r["checkpoint_slots"]): r["host_tier_of_ceiling"]
             for seed, rep in by_seed.items() for r in rep["rows"]}
    keys = list(dict.fromkeys((t, b) for (_, t, b) in share))
    head = ("| trace | device ckpt slots | " + " | ".join(f"seed {s}" for s in seeds) + " | min | mean |\n|---|---|"
            + "---|" * (len(seeds) + 2) + "\n")
    lines = []
    for t, b in keys:
        v = [share[(s, t, b)] for s in seeds]
        lines.append(f"| {t} | {b} | " + " | ".join(f"{x:.1%}" for x in v) + f" | {min(v):.1%} | {sum(v) / len(v):.1%} |")
    return head + "\n".join(lines) + "\n"


def _name(policy: str) -> str:
    return f"{policy} (default)" if policy == DEFAULT_POLICY else policy


def markdown(report: dict, at_slots: int) -> str:
    head = ("| trace | policy | ckpt slots (GiB) | token hit rate | % of ceiling | requests hit | hits < 528 tokens "
            "| prefill chunks | peak ckpts (GiB) | prefill FLOPs saved |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['trace']} | {_name(r['policy'])} | {r['checkpoint_slots']} ({r['checkpoint_gib']:.2f}) "
             f"| {r['hit_rate']:.1%} | {r['of_ceiling']:.0%} | {r['requests_hit']}/{r['requests']} | {r['short_hits']} "
             f"| {r['prefill_chunks']} | {r['peak_checkpoints']} ({r['peak_checkpoint_gib']:.2f}) "
             f"| {r['prefill_pflops_saved']:.2f} PFLOP ({r['prefill_flops_saved_share']:.1%}) |"
             for r in report["rows"] if r["checkpoint_slots"] == at_slots and r["policy"] in POLICIES]
    return head + "\n".join(lines) + "\n"


def sweep_markdown(report: dict) -> str:
    """Per trace: the attention-only ceiling, then each policy's token hit rate as a % of it at
    every checkpoint budget (columns)."""
    b = report["budgets"]
    share = {(r["trace"], r["policy"], r["checkpoint_slots"]): r["of_ceiling"] for r in report["rows"]}
    head = ("| trace (ceiling) | policy | " + " | ".join(f"{s} slots" for s in b) + " |\n|---|---|"
            + "---|" * len(b) + "\n")
    lines = []
    for t, c in report["ceilings"].items():
        for p in list(dict.fromkeys(r["policy"] for r in report["rows"])):
            lines.append(f"| {t} ({c['hit_rate']:.1%}) | {_name(p)} | "
                         + " | ".join(f"{share[(t, p, s)]:.0%}" for s in b) + " |")
    return head + "\n".join(lines) + "\n"


def burst_figure(report: dict, at_slots: int) -> str:
    """Prefill tokens the burst computes under the default policy vs the attention-only ceiling."""
    c = report["ceilings"]["burst"]
    r = next(r for r in report["rows"]
             if r["trace"] == "burst" and r["policy"] == DEFAULT_POLICY and r["checkpoint_slots"] == at_slots)
    ceil_prefill = c["prompt_tokens"] - c["hit_tokens"]
    return (f"burst ({r['requests']} requests, one cold shared prompt, {at_slots} checkpoint slots): "
            f"{DEFAULT_POLICY} computes {r['prefill_tokens']} prefill tokens, the attention-only ceiling "
            f"{ceil_prefill} ({r['prefill_tokens'] / ceil_prefill:.2f}x); hit rate {r['hit_rate']:.1%} vs "
            f"{c['hit_rate']:.1%}\n")


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["ceilings"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), sharey=True)
    for ax, trace in zip(axes, names):
        for policy in POLICIES:
            pts = [(r["checkpoint_gib"], r["of_ceiling"] * 100) for r in report["rows"]
                   if r["trace"] == trace and r["policy"] == policy]
            ax.plot(*zip(*pts), marker="o", label=_name(policy), lw=2.5 if policy == DEFAULT_POLICY else 1)
        ax.set_xscale("log", base=2)
        xs = sorted({r["checkpoint_gib"] for r in report["rows"]})
        ax.set_xticks(xs, [f"{x:.2g}" for x in xs])
        ax.minorticks_off()
        ax.set_title(f"{trace} (ceiling {report['ceilings'][trace]['hit_rate']:.0%})")
        ax.set_xlabel("checkpoint memory (GiB, Bamba-9B slots)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("token hit rate, % of attention-only ceiling")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_prefix_out", help="folder for results.md, results.json, hit_rate.png")
    ap.add_argument("--small", action="store_true", help="small traces and budgets (the test)")
    ap.add_argument("--table-slots", type=int, default=16, help="checkpoint slots of the printed table")
    ap.add_argument("--host-x", type=int, default=8,
                    help="the memory-tier table's host tier, in device checkpoint bytes (default 8)")
    ap.add_argument("--tiers-only", action="store_true", help="only the memory-tier table (tiers.md, tiers.json)")
    ap.add_argument("--trace-seeds", type=int, nargs="+", metavar="SEED",
                    help="only the memory tiers' share of the ceiling with every trace drawn with each seed (seeds.md)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.trace_seeds:
        by_seed = {s: run_tiers(host_x=a.host_x, seed=s) for s in a.trace_seeds}
        table = seeds_markdown(by_seed)
        (out / "seeds.md").write_text(f"Memory tiers, host tier {a.host_x}x: share of the ceiling by trace seed\n\n{table}")
        print(table)
        print(f"wrote {out}/seeds.md in {time.perf_counter() - t0:.1f} s")
        return by_seed
    tiers = run_tiers(a.small, host_x=a.host_x)
    tier_table = tiers_markdown(tiers)
    (out / "tiers.md").write_text(f"Memory tiers: {DEFAULT_POLICY}, host tier {a.host_x}x the device checkpoint "
                                  f"bytes\n\n{tier_table}")
    (out / "tiers.json").write_text(json.dumps(tiers, indent=1))
    print(tier_table)
    if a.tiers_only:
        print(f"wrote {out}/tiers.md, tiers.json in {time.perf_counter() - t0:.1f} s")
        return tiers
    report = run(a.small)
    report["tiers"] = tiers
    report["seconds"] = time.perf_counter() - t0
    report["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}"
    at = a.table_slots
    fig, table, sweep = burst_figure(report, at), markdown(report, at), sweep_markdown(report)
    gib = report["state_bytes_per_slot"] / 2**30
    (out / "results.md").write_text(
        f"{report['machine']}; {report['seconds']:.0f} s\n\n{fig}\nCheckpoint budget {at} slots:\n\n{table}"
        f"\nToken hit rate as a % of the attention-only ceiling (one slot = {gib:.3f} GiB):\n\n{sweep}")
    (out / "results.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "hit_rate.png")
    print(fig)
    print(table)
    print(sweep)
    print(f"wrote {out}/results.md, results.json, hit_rate.png in {report['seconds']:.1f} s")
    return report


if __name__ == "__main__":
    main()
