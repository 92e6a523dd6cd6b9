"""Engine overhead per decode step: CPU time of `step()` minus the model forward and the sampler call.

    python benchmarks/bench_step_overhead.py                        # 256 running decodes, stub forward
    python benchmarks/bench_step_overhead.py --requests 32 --real   # batch 32, the real tiny Bamba
    python benchmarks/bench_step_overhead.py --before /tmp/old      # alternate with another checkout

N requests (16-200 random prompt tokens, greedy, EOS ignored) are prefilled, then decode steps are
timed with `time.process_time` (1 torch thread): the whole step, the model call (a stub returning
zero logits [N, vocab], or with --real the tiny Bamba of bench_engine.py: hidden 256, 8 layers,
attention at 3 and 7), the sampler call, `schedule()` and the manager's `commit` (with
the decode batch's `DecodeRows.commit`; `commit_decodes` in older trees). Overhead = step - model - sampler:
scheduling, the batch build, commits and checkpoints, stop checks, outputs. Steps run as
`LLM.generate` runs them (`step(finished_only=True)`: outputs of finished requests only); with
--stream every step returns every advanced request's output, as the server's stepping does.
Each repeat runs in a fresh process; with --before PATH (a checkout laid out like this one, e.g.
`git archive <commit> | tar -x -C PATH`) the two trees alternate, PATH first. Per tree: the median
over repeats of each repeat's median step, with min-max. Goal (issue 12): < 1 ms at 256 requests,
< 5% of a decode step at batch 32.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
REAL_BAMBA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, attn_layer_indices=[3, 7],
                  mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64)


class _Timed:
    """Forwards calls to `inner`, adding each call's CPU seconds to acc[key]; a call made inside
    another timed call of the same key (a batched commit calling commit) is counted once."""

    def __init__(self, inner, acc: dict, key: str):
        self.inner, self.acc, self.key = inner, acc, key

    def __call__(self, *a, **k):
        depth = ("depth", self.key)
        outer = not self.acc.get(depth)
        self.acc[depth] = self.acc.get(depth, 0) + 1
        t0 = time.process_time()
        try:
            return self.inner(*a, **k)
        finally:
            self.acc[depth] -= 1
            if outer:
                self.acc[self.key] = self.acc.get(self.key, 0.0) + time.process_time() - t0

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _StubModel:
    def __init__(self, model):
        self.vocab_size, self.device = model.vocab_size, model.device

    def __call__(self, batch, caches):
        import torch
        return torch.zeros(batch.num_reqs, self.vocab_size)


def one_run(num_reqs: int, steps: int, real: bool, stream: bool = False) -> dict:
    """Medians (ms) of one process's decode steps: step, overhead, model, sampler, schedule, commit."""
    import torch
    torch.set_num_threads(1)
    from hybridkv import LLM, SamplingParams
    from hybridkv.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint("bamba", d, **(REAL_BAMBA if real else {}))
        llm = LLM(str(path), memory_budget_bytes=256 << 20, max_num_seqs=num_reqs, max_num_batched_tokens=8192)
    eng, acc = llm.engine, {}
    runner = getattr(eng, "runner", eng)  # the model runner (older trees: the engine held the model)
    runner.model = _Timed(llm.model if real else _StubModel(llm.model), acc, "model")
    runner.sampler = _Timed(runner.sampler, acc, "sampler")
    if hasattr(runner.sampler.inner, "greedy"):  # a decode batch's greedy rows (absent in older trees)
        runner.sampler.greedy = _Timed(runner.sampler.inner.greedy, acc, "sampler")
    eng.scheduler.schedule = _Timed(eng.scheduler.schedule, acc, "schedule")
    eng.mgr.commit = _Timed(eng.mgr.commit, acc, "commit")
    if hasattr(eng.mgr, "commit_decodes"):  # the batched commit of plain decodes (older trees)
        eng.mgr.commit_decodes = _Timed(eng.mgr.commit_decodes, acc, "commit")
    else:  # the decode batch's handle commits (hybridkv/decode_rows.py)
        from hybridkv.decode_rows import DecodeRows
        timed = _Timed(DecodeRows.commit, acc, "commit")
        DecodeRows.commit = lambda self, *a, **k: timed(self, *a, **k)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for _ in range(num_reqs):
        llm.add_request([rng.randrange(4, llm.model.vocab_size) for _ in range(rng.randint(16, 200))], params)
    while eng.scheduler.waiting or any(eng.mgr.request(s.request_id).num_computed_tokens < s.num_tokens - 1
                                       for s in eng.scheduler.running):
        eng.step()  # prefill everyone
    rows: dict[str, list[float]] = {}
    for i in range(steps + 5):  # 5 untimed warm-up decodes
        acc.clear()
        t0 = time.process_time()
        eng.step(finished_only=not stream)
        total = time.process_time() - t0
        if i < 5:
            continue
        over = total - acc["model"] - acc.get("sampler", 0.0)
        for key, v in (("step", total), ("overhead", over), ("model", acc["model"]), ("sampler", acc.get("sampler", 0.0)),
                       ("schedule", acc["schedule"]), ("commit", acc.get("commit", 0.0)),
                       ("overhead_share", over / total)):
            rows.setdefault(key, []).append(v)
    return {k: statistics.median(v) * (1 if k == "overhead_share" else 1e3) for k, v in rows.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real", action="store_true", help="the real tiny Bamba forward instead of a stub")
    ap.add_argument("--stream", action="store_true",
                    help="every step returns every advanced request's output (the server's path); default: "
                         "only finished ones, as LLM.generate asks")
    ap.add_argument("--before", default="", help="another checkout to alternate with (runs first)")
    ap.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_run:
        print(json.dumps(one_run(args.requests, args.steps, args.real, args.stream)))
        return 0
    results = run_trees(Path(__file__), ["--requests", str(args.requests), "--steps", str(args.steps)]
                        + (["--real"] if args.real else []) + (["--stream"] if args.stream else []),
                        args.before, args.repeats)
    print(f"{args.requests} running decodes, {'real tiny Bamba' if args.real else 'stub'} forward, "
          f"{'every step' if args.stream else 'finished'} outputs, "
          f"{args.steps} steps x {args.repeats} repeats, CPU ms per step: median (min-max) of repeat medians")
    for name, runs in results.items():
        cells = []
        for key in ("overhead", "schedule", "commit", "sampler", "model", "step", "overhead_share"):
            vals = [r[key] for r in runs]
            fmt = (lambda v: f"{100 * v:.1f}%") if key == "overhead_share" else (lambda v: f"{v:.2f}")
            cells.append(f"{key} {fmt(statistics.median(vals))} ({fmt(min(vals))}-{fmt(max(vals))})")
        print(f"  {name}: " + ", ".join(cells))
    if args.before:  # each repeat's pair ran back to back: their ratio drifts less with the machine
        pairs = [t["overhead"] / b["overhead"] for b, t in zip(results["before"], results["this"])]
        print(f"  overhead this/before, per repeat's pair: median {statistics.median(pairs):.2f}x "
              f"({min(pairs):.2f}-{max(pairs):.2f}x)")
    return 0


def run_trees(script: Path, args: list[str], before: str, repeats: int) -> dict[str, list[dict]]:
    """`script --one-run *args` in a fresh process per repeat, alternating this checkout with
    `before` (another checkout, run first) when given; {"before", "this": each run's last line as JSON}."""
    trees = ([("before", Path(before).resolve())] if before else []) + [("this", HERE)]
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(repeats):
        for name, root in trees:
            env = dict(os.environ, PYTHONPATH=str(_importable(root)))
            cmd = [sys.executable, str(script.resolve()), "--one-run"] + args
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
    return results


def _importable(root: Path) -> Path:
    """A directory from which `import hybridkv` (with .scheduler, .kernels, .models) reads `root`'s
    code: `root` itself for this checkout's editable install, else links beside a copy of the layout."""
    if root == HERE:
        return root
    pkg = root / "hybridkv"
    for sub in ("scheduler", "kernels", "models"):
        link = pkg / sub
        if not link.exists():
            link.symlink_to(Path("..") / sub)
    return root


if __name__ == "__main__":
    sys.exit(main())
