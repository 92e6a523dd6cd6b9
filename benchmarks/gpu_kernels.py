"""GPU kernel benchmark for a lent GPU (finishes in about 5 minutes on an H200).

1. device-to-device copy bandwidth (the roofline for memory-bound kernels);
2. every Triton kernel against its torch reference, fp16 and bf16 (MISSING if not written yet);
3. timings (triton.testing.do_bench, median): paged decode (batch 64 x context 4096, 32 q heads,
   8 KV heads, head dim 128, block 16) in bytes/s against the copy bandwidth, against torch SDPA
   on the same KV stored contiguously and against a naive torch gather + SDPA paged path; a varlen
   prefill batch in TFLOP/s; the decode state updates in bytes/s;
4. a tiny Bamba through the engine, Triton backend against torch backend (identical tokens).
Prints a table last; writes gpu_kernels.json under $OUT (or --out) when set.

    python benchmarks/gpu_kernels.py                 # on a CUDA GPU
    python benchmarks/gpu_kernels.py --cpu-dry-run   # tiny sizes on CPU: checks run the Triton
        kernels in the interpreter (fp32/fp16), timings use the torch references
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

DRY = "--cpu-dry-run" in sys.argv
if DRY:  # must precede the first Triton kernel import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_kernel_cases as cases  # noqa: E402
import gpu_model_case  # noqa: E402
from hybridkv.kernels import attention_ref  # noqa: E402


def timer(dry):
    """Median milliseconds of fn(): do_bench on the GPU, perf_counter on the CPU dry run."""
    if not dry:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu(fn):
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return cpu


def copy_bandwidth(dev, ms_of, nbytes):
    """Bytes/s of dst.copy_(src): read plus write of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (ms_of(lambda: dst.copy_(src)) * 1e-3)


def attention_fn(dry):
    if dry:
        return attention_ref.paged_attention_ref
    from hybridkv.kernels.paged_attention_kernel import paged_attention_triton
    return paged_attention_triton


def decode_rows(dev, dtype, ms_of, dry, copy_bw):
    """Paged decode vs SDPA on contiguous KV vs a naive gather + SDPA; bytes = the KV read."""
    b, ctx, hq, hkv, d, bs = (2, 64, 4, 2, 64, 16) if dry else (64, 4096, 32, 8, 128, 16)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, kv, qsl, lens, table = cases.paged_batch([(1, ctx)] * b, bs, hkv, hq, d, dtype, dev, gen)
    scale = d ** -0.5
    kv_bytes = b * ctx * hkv * d * 2 * kv.element_size()
    attn = attention_fn(dry)
    # the same KV, stored contiguously per request: [B, Hkv, ctx, D]
    gathered = kv[table.long()]  # [B, nblk, 2, bs, Hkv, D]
    kc = gathered[:, :, 0].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()
    vc = gathered[:, :, 1].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()
    del gathered
    q4 = q.view(b, hq, 1, d)
    # GQA decode as SDPA: the group's query heads act as query rows over the shared KV head
    qg = q.view(b, hkv, hq // hkv, d)

    def paged():
        return attn(q, kv, qsl, lens, table, scale, max_query_len=1, max_seq_len=ctx)

    def naive():
        g = kv[table.long()]
        k = g[:, :, 0].reshape(b, ctx, hkv, d).transpose(1, 2)
        v = g[:, :, 1].reshape(b, ctx, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    want = F.scaled_dot_product_attention(qg, kc, vc, scale=scale).reshape(b, hq, d)
    err = cases.rel_err(paged().view(b, hq, d), want)
    rows = []
    for name, fn in [
        ("decode paged (ours)", paged),
        ("decode SDPA contiguous, enable_gqa", lambda: F.scaled_dot_product_attention(
            q4, kc, vc, scale=scale, enable_gqa=True)),
        ("decode SDPA contiguous, group as rows", lambda: F.scaled_dot_product_attention(
            qg, kc, vc, scale=scale)),
        ("decode naive gather + SDPA", naive),
    ]:
        ms = ms_of(fn)
        bw = kv_bytes / (ms * 1e-3)
        rows.append({"case": name, "ms": ms, "GB/s": bw / 1e9, "of_copy_bw": bw / copy_bw,
                     "shape": f"B{b} ctx{ctx} Hq{hq} Hkv{hkv} D{d} bs{bs}"})
    rows[0]["rel_err_vs_sdpa"] = err
    best_sdpa = min(rows[1]["ms"], rows[2]["ms"])
    rows[0]["speedup_vs_best_sdpa_contiguous"] = best_sdpa / rows[0]["ms"]
    rows[0]["speedup_vs_naive_paged"] = rows[3]["ms"] / rows[0]["ms"]
    return rows


def prefill_rows(dev, dtype, ms_of, dry):
    """A varlen causal prefill batch: ours vs SDPA looped over requests (contiguous KV)."""
    lens = [16, 33, 7] if dry else [512, 1024, 2048, 300, 4096, 100]
    hq, hkv, d, bs = (4, 2, 64, 16) if dry else (32, 8, 128, 16)
    gen = torch.Generator(device=dev).manual_seed(1)
    q, kv, qsl, seq_lens, table = cases.paged_batch([(n, n) for n in lens], bs, hkv, hq, d, dtype,
                                                    dev, gen)
    scale, attn = d ** -0.5, attention_fn(dry)
    flops = sum(4 * d * hq * n * (n + 1) // 2 for n in lens)  # QK^T and PV over visible pairs
    per_req = []
    for r, n in enumerate(lens):
        blocks = table[r, :math.ceil(n / bs)].long()
        g = kv[blocks].transpose(1, 0).reshape(2, -1, hkv, d)[:, :n].transpose(1, 2)
        qr = q[int(qsl[r]):int(qsl[r + 1])].transpose(0, 1).unsqueeze(0)
        # KV heads repeated up front so SDPA takes its flash path whatever its GQA support
        k, v = (x.repeat_interleave(hq // hkv, dim=0).unsqueeze(0).contiguous() for x in g)
        per_req.append((qr, k, v))

    def ours():
        return attn(q, kv, qsl, seq_lens, table, scale, max_query_len=max(lens))

    def sdpa():
        return [F.scaled_dot_product_attention(a, k, v, scale=scale, is_causal=True)
                for a, k, v in per_req]

    rows = []
    for name, fn in [("prefill varlen paged (ours)", ours), ("prefill SDPA per request", sdpa)]:
        ms = ms_of(fn)
        rows.append({"case": name, "ms": ms, "TFLOP/s": flops / (ms * 1e-3) / 1e12,
                     "shape": f"lens {lens} Hq{hq} Hkv{hkv} D{d}"})
    return rows


def state_rows(dev, dtype, ms_of, dry, copy_bw):
    """Decode state updates: bytes = the batch's states read and written."""
    gen = torch.Generator(device=dev).manual_seed(2)
    specs = [
        ("mamba1_state_update", "mamba1", "mamba1_state_update_triton", "mamba1_state_update_ref",
         cases.mamba1_inputs),
        ("mamba2_state_update", "mamba2", "mamba2_state_update_triton", "mamba2_state_update_ref",
         cases.mamba2_inputs),
        ("gdn_state_update", "gdn", "gdn_state_update_triton", "gdn_state_update_ref",
         cases.gdn_inputs),
        ("lightning_state_update", "lightning", "lightning_state_update_triton",
         "lightning_state_update_ref", cases.lightning_inputs),
        ("kda_state_update", "kda", "kda_state_update_triton", "kda_state_update_ref",
         cases.kda_inputs),
    ]
    rows = []
    for name, module, tname, rname, make in specs:
        sizes = cases.STATE_SIZES[module][0 if dry else 1]
        fn = getattr(__import__(f"hybridkv.kernels.{module}_ref", fromlist=[rname]), rname)
        if not dry:
            fn = cases.triton_fn(module, tname)
            if fn is None:
                print(f"MISSING {name}: hybridkv.kernels.{module}.{tname} not found; not timed")
                rows.append({"case": name, "status": "MISSING"})
                continue
        state, args = make(dtype, dev, gen, *sizes)
        nbytes = 2 * state[0].numel() * state.element_size() * sizes[0]
        ms = ms_of(lambda: fn(state, *args))
        bw = nbytes / (ms * 1e-3)
        rows.append({"case": name, "ms": ms, "GB/s": bw / 1e9, "of_copy_bw": bw / copy_bw,
                     "shape": f"batch {sizes[0]} state {tuple(state.shape[1:])}"})
    return rows


def print_table(copy_bw, checks, timings):
    print("\n=== checks (Triton vs torch reference) ===")
    for c in checks:
        err = "-" if c["rel_err"] is None else f"{c['rel_err']:.2e}"
        print(f"{c['kernel']:<24} {c['dtype']:<9} {c['status']:<8} rel_err {err:<9} "
              f"tol {c['tol']:.0e}")
    print(f"\n=== timings (median) | copy bandwidth {copy_bw / 1e9:.1f} GB/s ===")
    print(f"{'case':<40} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8}")
    for r in timings:
        if r.get("status") == "MISSING":
            print(f"{r['case']:<40} MISSING")
            continue
        pct = f"{100 * r['of_copy_bw']:.0f}" if "of_copy_bw" in r else "-"
        gbs = f"{r['GB/s']:.0f}" if "GB/s" in r else "-"
        tf = f"{r['TFLOP/s']:.1f}" if "TFLOP/s" in r else "-"
        print(f"{r['case']:<40} {r['ms']:>9.3f} {gbs:>8} {pct:>6} {tf:>8}")
    d = next((r for r in timings if r["case"] == "decode paged (ours)"), None)
    if d:
        print(f"paged decode: {d['speedup_vs_best_sdpa_contiguous']:.2f}x best contiguous SDPA, "
              f"{d['speedup_vs_naive_paged']:.2f}x naive gather+SDPA, rel err vs SDPA "
              f"{d['rel_err_vs_sdpa']:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_kernels.json")
    args = ap.parse_args()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device found; run with --cpu-dry-run to exercise the script on a CPU")
    dev = torch.device("cpu" if args.cpu_dry_run else "cuda")
    ms_of = timer(args.cpu_dry_run)
    start = time.time()
    copy_bw = copy_bandwidth(dev, ms_of, (1 << 20) * (4 if args.cpu_dry_run else 1024))
    print(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s", flush=True)
    # the interpreter's bf16 tl.dot is wrong, so the CPU dry run checks fp32 and fp16
    dtypes = ([torch.float32, torch.float16] if args.cpu_dry_run
              else [torch.float16, torch.bfloat16])
    checks = cases.run_checks(dtypes, dev, small=args.cpu_dry_run)
    dtype = torch.float32 if args.cpu_dry_run else torch.bfloat16
    timings = decode_rows(dev, dtype, ms_of, args.cpu_dry_run, copy_bw)
    timings += prefill_rows(dev, dtype, ms_of, args.cpu_dry_run)
    timings += state_rows(dev, dtype, ms_of, args.cpu_dry_run, copy_bw)
    model_rows = gpu_model_case.bamba_rows(dev, small=args.cpu_dry_run)
    timings += model_rows
    device = "cpu (dry run)" if args.cpu_dry_run else torch.cuda.get_device_name()
    print_table(copy_bw, checks, timings)
    print(f"device {device}, timing dtype {dtype}, wall {time.time() - start:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        report = {"date": datetime.date.today().isoformat(), "device": device,
                  "torch": torch.__version__, "dtype": str(dtype), "copy_GB/s": copy_bw / 1e9,
                  "checks": checks, "timings": timings}
        with open(os.path.join(args.out, "gpu_kernels.json"), "w") as f:
            json.dump(report, f, indent=1)
    bad = [c for c in checks + model_rows if c.get("status") in ("FAIL", "ERROR")]
    if bad:
        sys.exit(f"{len(bad)} kernel check(s) failed: "
                 + ", ".join(c.get("kernel", c.get("case")) for c in bad))


if __name__ == "__main__":
    main()
