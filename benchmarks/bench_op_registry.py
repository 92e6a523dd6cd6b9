"""What an op's dispatch costs per call: hybridkv's registry (kernels/ops.py) against torch.library.

    python benchmarks/bench_op_registry.py --repeats 15 --calls 3000 [--before 3b32461]

The op is the smallest one a batch-1 CPU decode step calls most (twice per layer): an RMSNorm of one
row of 256 fp32 values, the C loop of kernels/rms_norm.py. Rows, microseconds per call:
- direct: kernels.rms_norm.rms_norm itself (no dispatch);
- registry: ops.rms_norm (kernels/ops.py: the backend from the device, the implementation by name);
- torch.library.custom_op: the same function as a custom op with a schema and a fake implementation,
  called through torch.ops (what the issue's "registered ops" would be);
- torch.library.Library.impl: the lower-level registration (a schema, a CPU kernel in Python).
Second table (`--before COMMIT`, e.g. 3b32461, the tree before the registry): the kernel calls of one
batch-1 decode step of bench_engine.py's Bamba (8 layers, 2 of attention: 16 residual add + norms,
the final norm, 2 rope-and-writes and 2 paged decodes, 6 fused Mamba2 decodes), on the same inputs,
through the registry and the checked C calls of this tree against `kernels/` at COMMIT (extracted
with `git archive` and imported as a top-level package; its Mamba2 decode as that tree's model called
it); totals per step, then per call of each op.
1 torch thread, CPU time (`time.process_time`), the rows alternating in each repeat (their order
reversed every other repeat); median over repeats (min-max) of the time per call and of each row's
difference to the direct call within a repeat (the dispatch's cost; the pairing cancels most of a
shared machine's drift). Prints the load average: the machine is shared.
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
from pathlib import Path

import torch

from hybridkv.kernels import native_cpu, ops
from hybridkv.kernels.rms_norm import rms_norm


def _time(fn, calls: int) -> float:
    c0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - c0) / calls * 1e6


def _torch_library_ops():
    """(custom_op, Library.impl) versions of rms_norm, under a namespace of this benchmark."""
    @torch.library.custom_op("hybridkv_bench::rms_norm", mutates_args=())
    def custom(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @custom.register_fake
    def _(x, weight, eps):
        return torch.empty_like(x)

    lib = torch.library.Library("hybridkv_bench_low", "DEF")
    lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
    lib.impl("rms_norm", lambda x, weight, eps: rms_norm(x, weight, eps), "CPU")
    return torch.ops.hybridkv_bench.rms_norm, torch.ops.hybridkv_bench_low.rms_norm, lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--before", metavar="COMMIT", help="also time a decode step's kernel calls against kernels/ at COMMIT")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native_cpu.library("rms_norm") is None:
        raise SystemExit("kernels/native/rms_norm.c did not build here: the row would time torch, not C")
    x, w = torch.randn(1, 256), torch.randn(256)
    custom, low, _lib = _torch_library_ops()
    rows = {
        "direct (kernels.rms_norm.rms_norm)": lambda: rms_norm(x, w, 1e-6),
        "registry (ops.rms_norm)": lambda: ops.rms_norm(x, w, 1e-6),
        "torch.library.custom_op": lambda: custom(x, w, 1e-6),
        "torch.library.Library.impl": lambda: low(x, w, 1e-6),
    }
    for fn in rows.values():  # warm up; every row computes the same
        torch.testing.assert_close(fn(), rms_norm(x, w, 1e-6))
    times = {name: [] for name in rows}
    for r in range(args.repeats):
        order = list(rows.items()) if r % 2 == 0 else list(reversed(rows.items()))
        for name, fn in order:
            times[name].append(_time(fn, args.calls))
    print(f"load average {os.getloadavg()}; 1 thread; RMSNorm of [1, 256] fp32; "
          f"{args.repeats} repeats x {args.calls} calls; us per call, median (min-max)")
    base = times["direct (kernels.rms_norm.rms_norm)"]
    print(f"  {'':38s} {'per call':>18s}   dispatch: the row minus direct, per repeat")
    for name, ts in times.items():
        diff = [t - b for t, b in zip(ts, base)]
        print(f"  {name:38s} {statistics.median(ts):7.2f} ({min(ts):.2f}-{max(ts):.2f})   "
              f"+{statistics.median(diff):.2f} ({min(diff):.2f}-{max(diff):.2f})")
    if args.before:
        compare_before(args.before, args.repeats, args.calls)


def _decode_step_calls(kern, native_cpu_mod, mixer_cls, registry: bool):
    """A function running one decode step's kernel calls (see the module docstring) through `kern`:
    this tree's ops (registry=True) or an older kernels package."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    H, HQ, HKV, D, BS, NB = 256, 4, 2, 64, 16, 64
    h, delta, w = r(1, H), r(1, H), r(H)
    qkv, cos, sin, kv = r(1, (HQ + 2 * HKV) * D), r(1, D), r(1, D), r(NB, 2, BS, HKV, D)
    slot_mapping = torch.tensor([37])
    qsl, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([38], dtype=torch.int32)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    Hh, P, N, K = 8, 64, 16, 4  # Mamba2: d_inner 512, 8 heads of 64, state 16, 1 group, conv 4
    conv_dim = Hh * P + 2 * N
    conv_state, ssm_state = r(8, conv_dim, K - 1), r(8, Hh, P, N)
    conv_w, conv_b, A_log, dt_bias, Dd, norm_w = r(conv_dim, 1, K), r(conv_dim), r(Hh), r(Hh), r(Hh), r(Hh * P)
    proj, slots, cache = r(1, Hh * P + conv_dim + Hh), torch.tensor([3], dtype=torch.int32), {}
    norms = kern if registry else importlib.import_module(kern.__name__ + ".rms_norm")

    def step():
        plans = {}
        for _ in range(16):
            norms.add_rms_norm(h, delta, w, 1e-6)
        norms.rms_norm(h, w, 1e-6)
        for _ in range(2):
            q = kern.rope_write_kv(qkv, (cos, sin), HQ, HKV, D, kv, slot_mapping, plan_cache=plans)
            kern.paged_attention(q, kv, qsl, seq_lens, table, 0.125, max_query_len=1, max_seq_len=38,
                                 plan_cache=plans)
        for _ in range(6):
            if registry:
                kern.mamba2_mixer_decode(proj, slots, conv_state=conv_state, ssm_state=ssm_state, num_heads=Hh,
                                         head_dim=P, n_groups=1, conv_weight=conv_w, conv_bias=conv_b, A_log=A_log,
                                         dt_bias=dt_bias, D=Dd, norm_weight=norm_w, norm_group=Hh * P, eps=1e-5,
                                         norm_mode=1, cache=cache, plan_cache=plans)
                continue
            if not (proj.is_cpu and native_cpu_mod.enabled()):  # that tree's Mamba2Mixer._decode_native
                raise SystemExit("native kernels off")
            tensors = (conv_state, ssm_state, conv_w, conv_b, A_log, dt_bias, Dd, norm_w)
            key = mixer_cls.key_of(*tensors)
            if cache.get("key") != key:
                cache["key"], cache["call"] = key, mixer_cls(conv_state, ssm_state, Hh, P, 1, conv_w.squeeze(1),
                                                             *tensors[3:], Hh * P, 1e-5, 1)
            cache["call"](proj, slots)
    return step


def compare_before(before: str, repeats: int, calls: int) -> None:
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as d:
        tar = subprocess.run(["git", "archive", before, "kernels"], cwd=repo, capture_output=True)
        if tar.returncode != 0:
            raise SystemExit(f"git archive {before} kernels failed: {tar.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", d], input=tar.stdout, check=True)
        sys.path.insert(0, d)
        old = importlib.import_module("kernels")  # that tree's hybridkv.kernels, as a top-level package
        old_native = importlib.import_module("kernels.native_cpu")
        old_mixer = importlib.import_module("kernels.mamba2_native").Mamba2MixerDecode
        rows = {f"kernels at {before}": _decode_step_calls(old, old_native, old_mixer, registry=False),
                "this tree (ops + checked C calls)": _decode_step_calls(ops, None, None, registry=True)}
        for fn in rows.values():
            fn()
        times = {name: [] for name in rows}
        for r in range(repeats):
            for name, fn in (list(rows.items()) if r % 2 == 0 else list(reversed(rows.items()))):
                times[name].append(_time(fn, max(1, calls // 30)))
    print(f"\none batch-1 decode step's kernel calls (Bamba of bench_engine.py), us per step, median (min-max)")
    base = times[f"kernels at {before}"]
    for name, ts in times.items():
        diff = [t - b for t, b in zip(ts, base)]
        print(f"  {name:38s} {statistics.median(ts):8.1f} ({min(ts):.1f}-{max(ts):.1f})   "
              f"{statistics.median(diff):+.1f} ({min(diff):+.1f}..{max(diff):+.1f})")


if __name__ == "__main__":
    main()
