"""What the checked C kernel calls of a batch-1 CPU decode step cost: this tree against another commit.

    python benchmarks/bench_native_calls.py --before 95e8cfd [--repeats 7 --calls 2000]
    python benchmarks/bench_native_calls.py --before 95e8cfd --part steps --rounds 5

Part "calls" (one process): the C-backed ops a batch-1 decode step of bench_engine.py's tiny Bamba
(8 layers, attention at 3 and 7) and tiny Llama (8 layers) make, called through `ops.<name>` on
inputs of those models' shapes: the residual add + RMSNorm of one row of 256, the final RMSNorm,
rope-and-KV-write (4 q heads, 2 KV heads of 64), the paged one-token decode (100 cached tokens; the
step's plan, built by a step's first layer, kept as the other layers find it) and Mamba2's fused decode (8 heads of 64, state 64, 1 group, conv 4). The same calls go through
`kernels/` at COMMIT (extracted with `git archive`, imported as a top-level package beside this
tree's hybridkv.kernels; a tree from before the ops registry, e.g. 3b32461, through the functions
its models called) and through this tree, the rows alternating (order reversed every other
repeat). Microseconds per call, median (min-max) over repeats; then per step (each op times its
count in a step: Bamba 16 add+norm, 1 norm, 2 rope-writes, 2 paged decodes, 6 Mamba2 decodes;
Llama 16 add+norm, 1 norm, 8 rope-writes, 8 paged decodes), with the paired difference per repeat.

Part "steps" (one process, COMMIT with an ops registry): batch-1 generations (64-token prompt, 64 new
tokens, greedy) of each tiny model through one `LLM`, the CPU time of each engine step; generations
alternate between COMMIT's kernels (every op's CPU implementation swapped for that tree's function)
and this tree's, so the engine, the model and the machine's drift are shared; the median decode step
per generation, median (min-max) over rounds, and the ratio within each round.

1 torch thread everywhere (OMP_NUM_THREADS=1, torch.set_num_threads(1)); CPU time
(`time.process_time`). The machine is shared: compare rows of one run, not runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
COUNTS = {"bamba": {"add_rms_norm": 16, "rms_norm": 1, "rope_write_kv": 2, "paged_attention": 2,
                    "mamba2_mixer_decode": 6},
          "llama": {"add_rms_norm": 16, "rms_norm": 1, "rope_write_kv": 8, "paged_attention": 8}}


def op_calls(ops) -> dict:
    """op name -> a function making one call of it through `ops` (a kernels.ops module), with
    bench_engine.py's tiny shapes; every call also checks it ran the C path."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    H, HQ, HKV, D, BS, NB, L = 256, 4, 2, 64, 16, 64, 100
    h, delta, w = r(1, H), r(1, H), r(H)
    qkv, cos, sin, kv = r(1, (HQ + 2 * HKV) * D), r(1, D), r(1, D), r(NB, 2, BS, HKV, D)
    slot_mapping = torch.tensor([L - 1])
    qsl, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([L], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    q = r(1, HQ, D)
    Hh, P, N, K = 8, 64, 64, 4
    conv_dim = Hh * P + 2 * N
    conv_state, ssm_state = r(8, conv_dim, K - 1), r(8, Hh, P, N) * 0.01
    conv_w, conv_b, A_log, dt_bias, Dd, norm_w = r(conv_dim, 1, K), r(conv_dim), r(Hh), r(Hh), r(Hh), r(Hh * P)
    proj, slots, cache = r(1, Hh * P + conv_dim + Hh), torch.tensor([3], dtype=torch.int32), {}
    plans = {}

    def paged():  # the step's plan (built by its first layer) is shared by the others: kept here
        return ops.paged_attention(q, kv, qsl, seq_lens, table, 0.125, max_query_len=1, max_seq_len=L,
                                   plan_cache=plans)

    def mixer():
        y = ops.mamba2_mixer_decode(proj, slots, conv_state=conv_state, ssm_state=ssm_state, num_heads=Hh,
                                    head_dim=P, n_groups=1, conv_weight=conv_w, conv_bias=conv_b, A_log=A_log,
                                    dt_bias=dt_bias, D=Dd, norm_weight=norm_w, norm_group=Hh * P, eps=1e-5,
                                    norm_mode=1, cache=cache, plan_cache=plans)
        assert y is not None, "the Mamba2 decode ran torch"
        return y

    def rope():
        y = ops.rope_write_kv(qkv, (cos, sin), HQ, HKV, D, kv, slot_mapping, plan_cache=plans)
        assert y is not None, "rope_write_kv ran torch"
        return y

    return {"add_rms_norm": lambda: ops.add_rms_norm(h, delta, w, 1e-6),
            "rms_norm": lambda: ops.rms_norm(h, w, 1e-6),
            "rope_write_kv": rope, "paged_attention": paged, "mamba2_mixer_decode": mixer}


def _time(fn, calls: int) -> float:
    c0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - c0) / calls * 1e6


def _tree(before: str, d: str) -> Path:
    """COMMIT's tree under d, importable as this checkout is (hybridkv/{kernels,models,scheduler} links)."""
    tar = subprocess.run(["git", "archive", before], cwd=HERE, capture_output=True)
    if tar.returncode != 0:
        raise SystemExit(f"git archive {before} failed: {tar.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", d], input=tar.stdout, check=True)
    root = Path(d)
    for sub in ("scheduler", "kernels", "models"):
        (root / "hybridkv" / sub).symlink_to(Path("..") / sub)
    return root


def part_calls(root: Path, label: str, repeats: int, calls: int) -> None:
    from hybridkv.kernels import native_cpu, ops

    if not native_cpu.enabled():
        raise SystemExit("native kernels are off (HYBRIDKV_CPU_NATIVE=0): nothing to time")
    sys.path.insert(0, str(root))
    old_ops = _ops_of_tree()
    trees = {label: op_calls(old_ops), "this tree": op_calls(ops)}
    for fns in trees.values():
        for fn in fns.values():
            fn()
    times = {t: {op: [] for op in fns} for t, fns in trees.items()}
    for rep in range(repeats):
        order = list(trees.items()) if rep % 2 == 0 else list(reversed(trees.items()))
        for op in COUNTS["bamba"]:
            for t, fns in order:
                times[t][op].append(_time(fns[op], calls if op != "paged_attention" else calls // 2))
    print(f"load average {os.getloadavg()}; 1 thread; {repeats} repeats x {calls} calls; "
          f"us per call, median (min-max); diff: this tree - {label}, per repeat")
    for op in COUNTS["bamba"]:
        a, b = times[label][op], times["this tree"][op]
        diff = [y - x for x, y in zip(a, b)]
        print(f"  {op:22s} {label}: {_fmt(a)}   this tree: {_fmt(b)}   diff {statistics.median(diff):+.2f} "
              f"({min(diff):+.2f}..{max(diff):+.2f})")
    for fam, counts in COUNTS.items():
        per = {t: [sum(n * times[t][op][rep] for op, n in counts.items()) for rep in range(repeats)]
               for t in trees}
        diff = [y - x for x, y in zip(per[label], per["this tree"])]
        print(f"  {fam} step's C-backed ops (us): {label}: {_fmt(per[label], 1)}   this tree: "
              f"{_fmt(per['this tree'], 1)}   diff {statistics.median(diff):+.1f} ({min(diff):+.1f}..{max(diff):+.1f})")


def _ops_of_tree():
    """COMMIT's hybridkv.kernels imported as the top-level package `kernels`: its ops registry, or for
    a tree from before it (3b32461) the same functions as the models of that tree called them."""
    try:
        return importlib.import_module("kernels.ops")
    except ModuleNotFoundError:
        pass
    norms, write_kv = importlib.import_module("kernels.rms_norm"), importlib.import_module("kernels.write_kv_cpu")
    attention, mixer = importlib.import_module("kernels.attention_cpu"), importlib.import_module("kernels.mamba2_native")

    def mamba2_mixer_decode(proj, slots, *, conv_state, ssm_state, num_heads, head_dim, n_groups, conv_weight,
                            conv_bias, A_log, dt_bias, D, norm_weight, norm_group, eps, norm_mode, cache,
                            plan_cache=None):  # that tree's Mamba2Mixer._decode_native
        tensors = (conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias, D, norm_weight)
        key = mixer.Mamba2MixerDecode.key_of(*tensors)
        if cache.get("key") != key:
            cache["key"], cache["call"] = key, mixer.Mamba2MixerDecode(
                conv_state, ssm_state, num_heads, head_dim, n_groups, conv_weight.squeeze(1), *tensors[3:],
                norm_group, eps, norm_mode)
        return cache["call"](proj, slots)

    return argparse.Namespace(add_rms_norm=norms.add_rms_norm, rms_norm=norms.rms_norm,
                              rope_write_kv=write_kv.rope_write_kv_cpu,
                              paged_attention=attention.paged_attention_cpu, mamba2_mixer_decode=mamba2_mixer_decode)


def _fmt(xs, digits=2) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


@contextmanager
def _kernels_of(old_ops):
    """Within the block every op's CPU implementation is COMMIT's (old_ops: its kernels.ops): each
    "module:function" of this registry set to that tree's function of the same name."""
    from hybridkv.kernels import ops

    saved = []
    for op in ops.OPS.values():
        old = old_ops.OPS.get(op.name)
        if op.cpu is None or old is None or old.cpu is None:
            continue
        module, fn = op.cpu.split(":")
        new_mod = importlib.import_module(f"hybridkv.kernels.{module}")
        old_mod, old_fn = old.cpu.split(":")
        saved.append((new_mod, fn, getattr(new_mod, fn)))
        setattr(new_mod, fn, getattr(importlib.import_module(f"kernels.{old_mod}"), old_fn))
    try:
        yield
    finally:
        for mod, fn, f in saved:
            setattr(mod, fn, f)


def part_steps(root: Path, label: str, rounds: int) -> None:
    """One engine per model; its generations alternate between COMMIT's kernels and this tree's."""
    sys.path.insert(0, str(root))
    old_ops = importlib.import_module("kernels.ops")
    sys.path.insert(0, str(HERE / "benchmarks"))
    from bench_engine import CONFIGS

    from hybridkv import LLM, SamplingParams
    from hybridkv.models.tiny import make_tiny_checkpoint

    for fam in COUNTS:
        with tempfile.TemporaryDirectory() as d:
            llm = LLM(str(make_tiny_checkpoint(fam, f"{d}/{fam}", **CONFIGS[fam])),
                      memory_budget_bytes=256 << 20, max_num_seqs=1)
        eng, steps = llm.engine, []
        step = eng.step

        def timed(*a, **k):
            c0 = time.process_time()
            try:
                return step(*a, **k)
            finally:
                steps.append(time.process_time() - c0)

        eng.step = timed
        params = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0)
        res, tokens = {label: [], "this tree": []}, set()
        for rnd in range(rounds + 1):
            order = [label, "this tree"] if rnd % 2 == 0 else ["this tree", label]
            for name in order:
                prompt = [[(7 * i + rnd) % 500 + 3 for i in range(64)]]
                with (_kernels_of(old_ops) if name == label else nullcontext()):
                    steps.clear()
                    out = llm.generate(prompt, params, use_tqdm=False)
                if rnd:  # round 0 warms up
                    res[name].append(statistics.median(steps[1:]) * 1e3)  # steps[0]: the prefill
                    tokens.add((rnd, tuple(out[0].outputs[0].token_ids)))
        ratio = [y / x for x, y in zip(res[label], res["this tree"])]
        print(f"  batch-1 {fam} decode step, ms CPU, median (min-max) of generations' medians: {label}: "
              f"{_fmt(res[label])}   this tree: {_fmt(res['this tree'])}   this/before per round "
              f"{statistics.median(ratio):.3f}x ({min(ratio):.3f}-{max(ratio):.3f}); tokens identical: "
              f"{len(tokens) == rounds}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="HEAD", metavar="COMMIT")
    ap.add_argument("--part", choices=("calls", "steps", "all"), default="calls")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10, help="generation pairs per model (part steps)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    label = f"at {args.before}"
    with tempfile.TemporaryDirectory() as d:
        root = _tree(args.before, d)
        if args.part in ("calls", "all"):
            part_calls(root, label, args.repeats, args.calls)
        if args.part in ("steps", "all"):
            part_steps(root, label, args.rounds)


if __name__ == "__main__":
    main()
