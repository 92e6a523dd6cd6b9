"""What an op's dispatch costs per call: hybridkv's registry (kernels/ops.py) against torch.library.

    python benchmarks/bench_op_registry.py --repeats 7

The op is the smallest one a batch-1 CPU decode step calls most (twice per layer): an RMSNorm of one
row of 256 fp32 values, the C loop of kernels/rms_norm.py. Rows, microseconds per call:
- direct: kernels.rms_norm.rms_norm itself (no dispatch);
- registry: ops.rms_norm (kernels/ops.py: the backend from the device, the implementation by name);
- torch.library.custom_op: the same function as a custom op with a schema and a fake implementation,
  called through torch.ops (what the issue's "registered ops" would be);
- torch.library.Library.impl: the lower-level registration (a schema, a CPU kernel in Python).
1 torch thread, CPU time (`time.process_time`), the rows alternating in each repeat (their order
reversed every other repeat); median over repeats (min-max) of the time per call and of each row's
difference to the direct call within a repeat (the dispatch's cost; the pairing cancels most of a
shared machine's drift). Prints the load average: the machine is shared.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

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


if __name__ == "__main__":
    main()
