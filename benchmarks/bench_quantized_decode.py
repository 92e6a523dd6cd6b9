"""Per call: the recurrent decode ops over quantized state pools against their float twins (issue 27).

    python benchmarks/bench_quantized_decode.py --repeats 7
    python benchmarks/bench_quantized_decode.py --repeats 7 --baseline 4cfe13a   # + that commit's Mamba2 C

What a step of one-token decodes costs one recurrent layer between its projections, on the CPU, one
torch thread: `ops.mamba2_mixer_decode` (float pools) against `ops.mamba2_mixer_decode_q` (int8 and
fp8 pools, each slot decoded, stepped and encoded in place), and the gated delta rule's decode
(`ops.conv1d_update` + `ops.gdn_state_update` on float pools) against `ops.gdn_decode_q` and against
what a step did before it ("staged": the batch's slots decoded into working tensors, the float decode,
encoded back: quantize.decode_gather / encode_scatter, as scheduler/cache_staging.py does). Shapes:
the Mamba2 layer of hybridkv/tiny-code (bench_quantized.py's model: 8 heads of 64, d_state 32, one
group, d_conv 4) and a GDN layer of Qwen3-Next's head sizes scaled down (4 key heads, 8 value heads,
head dims 64, d_conv 4); batch 8 over slots scattered in a pool of 32 (as the engine's are). Each
repeat runs every variant in turn (alternating, on the same inputs); a repeat's figure is CPU time
(`time.process_time`) per call averaged over `--inner` calls. Printed: the median and min-max over
repeats, and each quantized variant's median over its float twin's. `--baseline COMMIT` adds the
Mamba2 mixer with kernels/native/ as it was at COMMIT (taken from git, built beside this tree's:
"int8 at COMMIT", "fp8_e4m3 at COMMIT"; the same Python call, only the C function swapped).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridkv.cache_dtype import conv_layout, state_layout
from hybridkv.kernels import native_cpu, ops, quantize

BATCH, SLOTS = 8, 32
ROOT = Path(__file__).resolve().parents[1]


def mamba2_case(dtype, H=8, P=64, N=32, G=1, k=4, seed=0, mixer_q=None):
    """(float call, quantized call) of one Mamba2 layer's decode at tiny-code's shapes; mixer_q: the
    quantized op's implementation (default ops.mamba2_mixer_decode_q)."""
    mixer_q = mixer_q or ops.mamba2_mixer_decode_q
    g = torch.Generator().manual_seed(seed)
    HP, conv_dim = H * P, H * P + 2 * G * N
    conv = torch.randn(SLOTS, conv_dim, k - 1, generator=g)
    ssm = torch.randn(SLOTS, H, P, N, generator=g) * 0.3
    weights = dict(num_heads=H, head_dim=P, n_groups=G, conv_weight=torch.randn(conv_dim, k, generator=g) * 0.5,
                   conv_bias=torch.randn(conv_dim, generator=g), A_log=torch.randn(H, generator=g) * 0.5,
                   dt_bias=torch.randn(H, generator=g) * 0.5, D=torch.randn(H, generator=g),
                   norm_weight=torch.randn(HP, generator=g), norm_group=HP, eps=1e-5, norm_mode=1)
    proj = torch.randn(BATCH, HP + conv_dim + H, generator=g)
    slots = torch.randperm(SLOTS - 1, generator=g)[:BATCH].add(1).to(torch.int32)
    cl, sl = conv_layout(dtype, (conv_dim, k - 1)), state_layout(dtype, (H, P, N))
    conv_q, ssm_q = cl.encode(conv), sl.encode(ssm)
    fc, qc = {}, {}

    def float_call():
        return ops.mamba2_mixer_decode(proj, slots, conv_state=conv, ssm_state=ssm, cache=fc, **weights)

    def quantized_call():
        return mixer_q(proj, slots, conv_pool=conv_q, conv_layout=cl, ssm_pool=ssm_q, ssm_layout=sl, cache=qc,
                       **weights)
    return float_call, quantized_call


def gdn_case(dtype, Hk=4, HV=8, dk=64, dv=64, k=4, seed=0):
    """(float call, quantized call) of one GDN layer's decode from the conv's input to the core output."""
    g = torch.Generator().manual_seed(seed)
    key_dim, conv_dim = Hk * dk, 2 * Hk * dk + HV * dv
    conv = torch.randn(SLOTS, conv_dim, k - 1, generator=g)
    state = torch.randn(SLOTS, HV, dk, dv, generator=g) * 0.3
    weight = torch.randn(conv_dim, k, generator=g) * 0.5
    mixed = torch.randn(BATCH, conv_dim, generator=g)
    gate, beta = -torch.rand(BATCH, HV, generator=g), torch.rand(BATCH, HV, generator=g)
    slots = torch.randperm(SLOTS - 1, generator=g)[:BATCH].add(1).to(torch.int32)
    cl, sl = conv_layout(dtype, (conv_dim, k - 1)), state_layout(dtype, (HV, dk, dv))
    conv_q, state_q = cl.encode(conv), sl.encode(state)

    def float_call():  # the mixer's float decode: conv1d_update, then gdn_state_update (q, k prepared inside)
        x = ops.conv1d_update(mixed, conv, weight, None, slots)
        q, kk, v = x.split([key_dim, key_dim, HV * dv], -1)
        return ops.gdn_state_update(state, q.reshape(BATCH, Hk, dk), kk.reshape(BATCH, Hk, dk),
                                    v.reshape(BATCH, HV, dv), gate, beta, slots)

    def quantized_call():
        return ops.gdn_decode_q(mixed, gate, beta, slots, conv_pool=conv_q, conv_layout=cl, state_pool=state_q,
                                state_layout=sl, conv_weight=weight, num_k_heads=Hk, head_k_dim=dk,
                                num_v_heads=HV, head_v_dim=dv)

    src, work = slots.long(), torch.arange(BATCH)
    conv_work = torch.empty(BATCH, conv_dim, k - 1)
    state_work = torch.empty(BATCH, HV, dk, dv)

    def staged_call():  # what a step did before the op: the slots decoded, the float decode, encoded back
        quantize.decode_gather(cl, conv_q, src, 1, conv_work)
        quantize.decode_gather(sl, state_q, src, 1, state_work)
        x = ops.conv1d_update(mixed, conv_work, weight, None, work)
        q, kk, v = x.split([key_dim, key_dim, HV * dv], -1)
        o = ops.gdn_state_update(state_work, q.reshape(BATCH, Hk, dk), kk.reshape(BATCH, Hk, dk),
                                 v.reshape(BATCH, HV, dv), gate, beta, work)
        quantize.encode_scatter(cl, conv_work, work, conv_q, src, 1)
        quantize.encode_scatter(sl, state_work, work, state_q, src, 1)
        return o
    quantized_call.staged = staged_call
    return float_call, quantized_call


def baseline_mixer_q(commit: str, workdir: str):
    """mamba2_mixer_decode_q as it was at `commit`: kernels/mamba2_native.py and kernels/native/ taken
    from git into workdir, the module imported inside hybridkv.kernels, its C built there."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "kernels/native", "kernels/mamba2_native.py"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", workdir], input=archive, check=True)
    name = f"hybridkv.kernels._baseline_mamba2_native_{commit}"
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__package__ = "hybridkv.kernels"
    sys.modules[name] = mod
    src = Path(workdir, "kernels", "mamba2_native.py")
    exec(compile(src.read_text(), f"{commit}:kernels/mamba2_native.py", "exec"), mod.__dict__)
    fn = native_cpu.library("mamba2_decode", src.parent / "native")["mamba2_mixer_decode"]
    fn.argtypes, fn.restype = [ctypes.POINTER(mod._MixerArgs)], ctypes.c_int
    mod._functions["mamba2_mixer_decode"] = fn
    return mod.mamba2_mixer_decode_q


def alternate(fns: dict, repeats: int, inner: int) -> dict:
    """{name: [CPU seconds per call, one per repeat]}, every variant run in turn in each repeat."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            t0 = time.process_time()
            for _ in range(inner):
                fn()
            times[name].append((time.process_time() - t0) / inner)
    return times


def cases(baseline_q=None, baseline: str = ""):
    """{label: (float call, {variant: quantized call})}; every call is checked to run its kernel, and a
    baseline's Mamba2 variants to give this tree's outputs."""
    out = {}
    for label, make in (("Mamba2 mixer decode", mamba2_case), ("GDN decode", gdn_case)):
        calls = {dtype: make(dtype) for dtype in ("int8", "fp8_e4m3")}
        float_call = calls["int8"][0]
        assert float_call() is not None and all(q() is not None for _, q in calls.values()), label
        quantized = {dtype: q for dtype, (_, q) in calls.items()}
        quantized.update({f"{dtype} staged": q.staged for dtype, q in quantized.items() if hasattr(q, "staged")})
        if baseline_q is not None and make is mamba2_case:
            for dtype in ("int8", "fp8_e4m3"):
                _, old = mamba2_case(dtype, mixer_q=baseline_q)
                assert torch.equal(old(), mamba2_case(dtype)[1]()), f"{baseline} computes otherwise ({dtype})"
                quantized[f"{dtype} at {baseline}"] = old
        out[label] = (float_call, quantized)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=100)
    ap.add_argument("--baseline", default=None, help="a commit whose Mamba2 quantized decode to time beside")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        baseline_q = baseline_mixer_q(a.baseline, tmp) if a.baseline else None
        table = cases(baseline_q, a.baseline or "")
    print(f"batch {BATCH} of {SLOTS} slots, 1 thread, CPU us per call, median of {a.repeats} (min-max):")
    for label, (float_call, quantized) in table.items():
        t = alternate({"float32": float_call, **quantized}, a.repeats, a.inner)
        res[label] = t
        base = statistics.median(t["float32"])
        for name, ts in t.items():
            ratio = "" if name == "float32" else f"  {statistics.median(ts) / base:.2f}x float32"
            print(f"  {label:20s} {name:19s} {1e6 * statistics.median(ts):7.1f} "
                  f"({1e6 * min(ts):.1f}-{1e6 * max(ts):.1f}){ratio}")
    return res


if __name__ == "__main__":
    main()
