"""The dense parts of a decoder layer on CPU, op by op: the torch path against what runs now.

    python benchmarks/bench_dense_ops_cpu.py --repeats 7

Rows (shapes of bench_engine.py's models: hidden 256, MLP 512, 4 query / 2 KV heads of 64, Mamba2
d_inner 512; fp32), each at 1 and 32 rows (a batch-1 and a batch-32 decode step):
- RMSNorm; residual add + RMSNorm; Mamba2's gated RMSNorm: torch (native kernels forced off) vs
  the C rows of kernels/rms_norm.py;
- rotary on q and k + the KV write: apply_rotary + write_kv_cpu vs kernels.rope_write_kv;
- the model's 33 matrices (8 layers of q/k/v, o, gate/up, down, and lm_head; 19 MB, more than the
  L3 cache, as in a real step): F.linear on row-major weights vs FusedLinear's CPU layout.
1 torch thread, CPU time (`time.process_time`), the two sides alternating in each repeat (which
goes first alternates too); median over repeats (min-max) of microseconds per call (per pass over
all 33 matrices for the linear row). Prints `uptime`'s load average: the machine is shared.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from hybridkv import kernels
from hybridkv.kernels import native_cpu
from hybridkv.kernels.rms_norm import add_rms_norm, rms_norm
from hybridkv.kernels.write_kv_cpu import write_kv_cpu
from hybridkv.models.norms import GatedRMSNorm
from hybridkv.models.rotary import apply_rotary

H, I, HQ, HKV, D, D_INNER, VOCAB, LAYERS, BS = 256, 512, 4, 2, 64, 512, 512, 8, 16


def _time(fn, calls: int) -> float:
    c0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - c0) / calls * 1e6


def compare(name: str, torch_side, now_side, calls: int, repeats: int, native_off: bool = True) -> None:
    """Alternate the two callables; print the median (min-max) us per call and the ratio."""
    sides = {"torch": [], "now": []}
    for rep in range(repeats):
        order = ["torch", "now"] if rep % 2 == 0 else ["now", "torch"]
        for side in order:
            if side == "torch" and native_off:
                with native_cpu.forced_off():
                    torch_side()  # warm
                    sides[side].append(_time(torch_side, calls))
            else:
                fn = torch_side if side == "torch" else now_side
                fn()
                sides[side].append(_time(fn, calls))
    med = {k: statistics.median(v) for k, v in sides.items()}
    cells = [f"{k} {med[k]:8.1f} us ({min(v):.1f}-{max(v):.1f})" for k, v in sides.items()]
    print(f"  {name:<44} {cells[0]}   {cells[1]}   {med['torch'] / med['now']:.2f}x", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=400, help="calls per repeat (the linear row: / 20)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native_cpu.library("rms_norm") is None or native_cpu.library("rope_write_kv") is None:
        print("native kernels unavailable here (no compiler, or HYBRIDKV_CPU_NATIVE=0): nothing to compare")
        return 1
    g = torch.Generator().manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; "
          f"1 thread, median (min-max) of {args.repeats} repeats; torch side with native kernels off")
    with torch.inference_mode():
        w = torch.randn(H, generator=g) * 0.1 + 1
        gated = GatedRMSNorm(D_INNER, D_INNER, eps=1e-5)
        weights = []
        for _ in range(LAYERS):
            weights += [torch.randn(n, k, generator=g) * 0.05 for n, k in
                        (((HQ + 2 * HKV) * D, H), (H, HQ * D), (2 * I, H), (H, I))]
        weights.append(torch.randn(VOCAB, H, generator=g) * 0.05)
        transposed = [wt.t().contiguous().t() for wt in weights]  # FusedLinear's CPU layout
        pool = torch.randn(64, 2, BS, HKV, D, generator=g)
        for rows in (1, 32):
            print(f"{rows} row(s):")
            x, d = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)
            compare("RMSNorm", lambda: rms_norm(x, w, 1e-5), lambda: rms_norm(x, w, 1e-5),
                    args.calls, args.repeats)
            compare("residual add + RMSNorm", lambda: add_rms_norm(x, d, w, 1e-5),
                    lambda: add_rms_norm(x, d, w, 1e-5), args.calls, args.repeats)
            y, z = torch.randn(rows, D_INNER, generator=g), torch.randn(rows, D_INNER, generator=g)
            compare("Mamba2 gated RMSNorm (d_inner 512)", lambda: gated(y, z), lambda: gated(y, z),
                    args.calls, args.repeats)
            qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=g)
            freqs = torch.arange(rows).float()[:, None] * 0.01 * torch.arange(D // 2).float()[None]
            emb = torch.cat((freqs, freqs), -1)
            rope = (emb.cos(), emb.sin())
            slots = torch.randperm(64 * BS, generator=g)[:rows].long()

            def rope_torch():
                qk = apply_rotary(qkv[:, :(HQ + HKV) * D].view(rows, HQ + HKV, D), *rope)
                write_kv_cpu(qk[:, HQ:], qkv[:, (HQ + HKV) * D:].view(rows, HKV, D), pool, slots, {})
                return qk[:, :HQ]

            compare("rotary on q, k + KV write", rope_torch,
                    lambda: kernels.rope_write_kv(qkv, rope, HQ, HKV, D, pool, slots),
                    args.calls, args.repeats)
            xs = {H: x, I: torch.randn(rows, I, generator=g)}
            compare("33 linears, 19 MB (us per pass over all)",
                    lambda: [F.linear(xs[wt.shape[1]], wt) for wt in weights],
                    lambda: [F.linear(xs[wt.shape[1]], wt) for wt in transposed],
                    max(1, args.calls // 20), args.repeats, native_off=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
