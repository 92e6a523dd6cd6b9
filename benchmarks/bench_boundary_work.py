"""The manager's work at block boundaries of a decode step, per call (issue 12: < 1 ms per step at 256).

    python benchmarks/bench_boundary_work.py                       # the default tiny Bamba's states
    python benchmarks/bench_boundary_work.py --real                # bench_engine's tiny Bamba (6 x 128 KiB)
    python benchmarks/bench_boundary_work.py --before /tmp/old     # alternate with another checkout

A HybridCacheManager with the tiny Bamba's layer specs (policy `junctions`, prefix caching on)
holds N running requests (16-200 random prompt tokens, prefilled); each decode step appends a
token to every request, allocates and commits it. At a step, the ~N/16 requests whose token
fills a block pay: `checkpoint_due` (at scheduling), `commit(rid, 1)` (hashing the block into
every kind), `checkpoint(rid)` (the rolling output checkpoint: the old one goes, a new one is
kept) inside `batched_checkpoints()`, and the deferred state copies at the context's exit. Each
group is timed with `time.process_time` (1 torch thread) around all its calls of a step; the
figure is CPU microseconds per call (copies: per step and per copied slot). Each repeat runs in a
fresh process; with --before PATH (e.g. `git archive <commit> | tar -x -C PATH`) the two trees
alternate, PATH first. Per tree: median over repeats of each repeat's per-call mean, with min-max.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_overhead import run_trees  # noqa: E402

KEYS = ("due", "commit", "checkpoint", "copies_per_step", "copies_per_slot", "boundary_per_step")


def _specs(real: bool) -> dict:
    import torch
    from hybridkv.specs import AttentionSpec, RecurrentSpec
    if real:  # hidden 256, Mamba2 8 heads x 64, d_state 64, conv 4: attention at 3 and 7
        rec = RecurrentSpec((512 + 2 * 64, 3), (8, 64, 64), torch.float32)
        attn, layers, at = AttentionSpec(2, 64, torch.float32), 8, (3, 7)
    else:  # make_tiny_checkpoint("bamba") defaults
        rec = RecurrentSpec((192, 3), (8, 16, 16), torch.float32)
        attn, layers, at = AttentionSpec(2, 16, torch.float32), 4, (1, 3)
    return {i: attn if i in at else rec for i in range(layers)}


def one_run(num_reqs: int, steps: int, real: bool) -> dict:
    """Per-call CPU microseconds of one process's boundary work over `steps` decode steps."""
    import torch
    torch.set_num_threads(1)
    from hybridkv.cache_manager import HybridCacheManager
    from hybridkv.request import Request

    rng = random.Random(1)
    mgr = HybridCacheManager(_specs(real), 16, num_reqs * 24, 2 * num_reqs + 64, fingerprint="bench")
    clock = time.process_time
    for rid in range(num_reqs):
        prompt = [rng.randrange(4, 512) for _ in range(rng.randint(16, 200))]
        mgr.admit(Request(rid, prompt))
        mgr.allocate(rid, len(prompt))
        mgr.commit(rid, len(prompt))
        mgr.append_tokens(rid, [rng.randrange(4, 512)])
    sums = {k: 0.0 for k in ("due", "commit", "checkpoint", "copies")}
    calls = copied = timed_steps = 0
    per_step: list[float] = []
    for step in range(steps + 4):  # 4 untimed warm-up steps
        starts = {rid: mgr.request(rid).num_computed_tokens for rid in range(num_reqs)}
        at_boundary = [rid for rid, s in starts.items() if not (s + 1) % 16]
        for rid in range(num_reqs):
            mgr.allocate(rid, 1)
        t0 = clock()
        due = [rid for rid in at_boundary if mgr.prefix_cache.checkpoint_due(rid, starts[rid], starts[rid] + 1) is not None]
        t1 = clock()
        for rid in at_boundary:
            mgr.commit(rid, 1)
        t2 = clock()
        for rid in range(num_reqs):
            if (starts[rid] + 1) % 16:
                mgr.commit(rid, 1)
        with mgr.prefix_cache.batched_checkpoints():
            t3 = clock()
            for rid in due:
                mgr.prefix_cache.checkpoint(rid)
            t4 = clock()
        t5 = clock()
        for rid in range(num_reqs):
            mgr.append_tokens(rid, [rng.randrange(4, 512)])
        if step < 4 or not at_boundary:
            continue
        timed_steps += 1
        calls += len(at_boundary)
        copied += len(due)
        for key, v in (("due", t1 - t0), ("commit", t2 - t1), ("checkpoint", t4 - t3), ("copies", t5 - t4)):
            sums[key] += v
        per_step.append(t2 - t0 + t5 - t3)
    us = 1e6
    return {"due": sums["due"] / calls * us, "commit": sums["commit"] / calls * us,
            "checkpoint": sums["checkpoint"] / max(1, copied) * us,
            "copies_per_step": sums["copies"] / timed_steps * us, "copies_per_slot": sums["copies"] / max(1, copied) * us,
            "boundary_per_step": statistics.median(per_step) * us, "boundaries_per_step": calls / timed_steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real", action="store_true", help="bench_engine's tiny Bamba (6 Mamba2 layers, 128 KiB states)")
    ap.add_argument("--before", default="", help="another checkout to alternate with (runs first)")
    ap.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_run:
        print(json.dumps(one_run(args.requests, args.steps, args.real)))
        return 0
    results = run_trees(Path(__file__), ["--requests", str(args.requests), "--steps", str(args.steps)]
                        + (["--real"] if args.real else []), args.before, args.repeats)
    per = results["this"][0]["boundaries_per_step"]
    print(f"{args.requests} decodes, {'real' if args.real else 'default'} tiny Bamba states, ~{per:.1f} block "
          f"boundaries per step, {args.steps} steps x {args.repeats} repeats; CPU us: median (min-max)")
    for name, runs in results.items():
        cells = []
        for key in KEYS:
            vals = [r[key] for r in runs]
            cells.append(f"{key} {statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})")
        print(f"  {name}: " + ", ".join(cells))
    if args.before:
        b, a = results["before"], results["this"]
        ratios = {k: [y[k] / x[k] for x, y in zip(b, a)] for k in KEYS}
        print("  this / before, per repeat pair: " + ", ".join(
            f"{k} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
from hybridkv.request import Request
