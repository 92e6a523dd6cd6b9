"""GPU kernel benchmark for a lent GPU (about 5 minutes on an H200; benchmarks/gpu_first.sh runs it).

Sections, each isolated (one that raises is recorded as ERROR and the next runs) with the JSON
rewritten after each, so a crash or a timeout keeps what was measured:
0. versions (torch, triton, transformers, GPU, driver);
1. device-to-device copy bandwidth (the roofline for memory-bound kernels);
2. warm-up: every Triton variant the engine launches (kernels/variants.py, default level) is
   launched once, so no timing below sees a JIT compile;
3. every Triton kernel against its torch reference, fp16 and bf16 (MISSING if not written yet);
4. timings (triton.testing.do_bench, median): paged decode at batch 64 x 4k and at batch 1 x 32k
   with split-KV on (the rule's choice) and off, in bytes/s against the copy bandwidth, against
   torch SDPA on the same KV stored contiguously and a naive torch gather + SDPA paged path; a
   varlen prefill batch in TFLOP/s; the decode state updates at batch 256 in bytes/s; the kernels
   over quantized caches against the float kernels they replace (gpu_quantized_case.py);
5. one Mamba2 and one attention layer at Bamba-9B width (gpu_layer_case.py): 4096-token prefill
   checked against the torch backend, decode step GPU vs host CPU time at batch 1 and 64;
6. a tiny Bamba through the engine, Triton backend against torch backend (identical tokens);
7. decode steps with CUDA graphs on vs off (gpu_model_case.graph_decode_rows): batch 1 and 64,
   host CPU and GPU time per step, the graph's logits checked against the eager step's.
Prints a table last; writes gpu_kernels.json under $OUT (or --out) when set. Exits 1 on a wrong
result (a check FAIL / ERROR) or a section that raised.

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
import gpu_layer_case  # noqa: E402
import gpu_quantized_case  # noqa: E402
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
    """paged attention taking num_kv_splits: the Triton kernel, or (dry run) the reference."""
    if dry:
        return lambda *a, num_kv_splits=None, **kw: attention_ref.paged_attention_ref(*a, **kw)
    from hybridkv.kernels.paged_attention_kernel import paged_attention_triton
    return paged_attention_triton


def decode_rows(dev, dtype, ms_of, dry, copy_bw, b, ctx):
    """Paged decode (split-KV by the rule, and forced off) vs SDPA on contiguous KV vs a naive
    gather + SDPA, batch b x context ctx; bytes = the KV read. Checked against SDPA."""
    hq, hkv, d, bs = (4, 2, 64, 16) if dry else (32, 8, 128, 16)
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
    from hybridkv.kernels.split_kv import kv_splits
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
        else 132
    splits = kv_splits(b, hkv, 1, ctx, sms)

    def paged(num_kv_splits=None):
        return attn(q, kv, qsl, lens, table, scale, max_query_len=1, max_seq_len=ctx,
                    num_kv_splits=num_kv_splits)

    def naive():
        g = kv[table.long()]
        k = g[:, :, 0].reshape(b, ctx, hkv, d).transpose(1, 2)
        v = g[:, :, 1].reshape(b, ctx, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    want = F.scaled_dot_product_attention(qg, kc, vc, scale=scale).reshape(b, hq, d)
    errs = {n: cases.rel_err(paged(n).view(b, hq, d), want) for n in (None, 1)}
    shape = f"B{b} ctx{ctx} Hq{hq} Hkv{hkv} D{d} bs{bs}"
    rows = []
    for name, fn in [
        (f"decode paged (ours), {splits} split(s)", paged),
        ("decode paged (ours), split-KV off", lambda: paged(1)),
        ("decode SDPA contiguous, enable_gqa", lambda: F.scaled_dot_product_attention(
            q4, kc, vc, scale=scale, enable_gqa=True)),
        ("decode SDPA contiguous, group as rows", lambda: F.scaled_dot_product_attention(
            qg, kc, vc, scale=scale)),
        ("decode naive gather + SDPA", naive),
    ]:
        ms = ms_of(fn)
        bw = kv_bytes / (ms * 1e-3)
        rows.append({"case": f"{name} [B{b} x {ctx}]", "ms": ms, "GB/s": bw / 1e9,
                     "of_copy_bw": bw / copy_bw, "shape": shape})
    tol = cases.TOL[dtype] * 5  # fp32 / bf16 accumulation orders differ from SDPA's
    for row, n in ((rows[0], None), (rows[1], 1)):
        row.update(rel_err_vs_sdpa=errs[n], kernel=row["case"], dtype=str(dtype),
                   status="PASS" if errs[n] < tol else "FAIL")
    best_sdpa = min(rows[2]["ms"], rows[3]["ms"])
    rows[0]["speedup_vs_best_sdpa_contiguous"] = best_sdpa / rows[0]["ms"]
    rows[0]["speedup_vs_naive_paged"] = rows[4]["ms"] / rows[0]["ms"]
    rows[0]["speedup_vs_split_off"] = rows[1]["ms"] / rows[0]["ms"]
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
        if "ms" not in r:  # a check row among the timings
            print(f"{r['case']:<40} {r.get('status', '-')}")
            continue
        pct = f"{100 * r['of_copy_bw']:.0f}" if "of_copy_bw" in r else "-"
        gbs = f"{r['GB/s']:.0f}" if "GB/s" in r else "-"
        tf = f"{r['TFLOP/s']:.1f}" if "TFLOP/s" in r else "-"
        print(f"{r['case']:<40} {r['ms']:>9.3f} {gbs:>8} {pct:>6} {tf:>8}")
    for d in (r for r in timings if "speedup_vs_best_sdpa_contiguous" in r):
        print(f"{d['case']}: {d['speedup_vs_best_sdpa_contiguous']:.2f}x best contiguous SDPA, "
              f"{d['speedup_vs_naive_paged']:.2f}x naive gather+SDPA, "
              f"{d['speedup_vs_split_off']:.2f}x split-KV off, rel err vs SDPA "
              f"{d['rel_err_vs_sdpa']:.1e}")


def versions(dev):
    import triton
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "triton": triton.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda}
    if dev.type == "cuda":
        out["device"] = torch.cuda.get_device_name(dev)
        out["sms"] = torch.cuda.get_device_properties(dev).multi_processor_count
        try:
            import subprocess
            out["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            out["driver"] = f"unknown ({type(e).__name__})"
    else:
        out["device"] = "cpu (dry run)"
    return out


DRY_WARM_UP = ("paged_attention", "write_kv", "conv1d_update")  # cheap when interpreted


def warm_up(dev, dry):
    """Launch every variant the engine launches (kernels/variants.py, default level) once, which
    compiles it; a launch that raises is an ERROR row. The dry run launches one variant of a few
    cheap kernels (interpreted: nothing to compile, only that the launches run)."""
    from hybridkv.kernels import variants

    chosen = variants.engine_variants("default")
    if dry:
        chosen = [next(v for v in chosen if v.op == op) for op in DRY_WARM_UP]
    rows, t0 = [], time.time()
    for v in chosen:
        try:
            v.launch(dev)
        except Exception as e:  # reported, and the exit status says so
            rows.append({"kernel": f"warm-up {v.name}", "dtype": str(v.dtype), "status": "ERROR",
                         "rel_err": None, "tol": 0.0, "error": f"{type(e).__name__}: {e}"})
            print(f"warm-up ERROR {v.name}: {type(e).__name__}: {e}", flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"warm-up: {len(chosen)} variants launched in {time.time() - t0:.1f} s", flush=True)
    return rows, {"variants": len(chosen), "seconds": time.time() - t0,
                  "missing": variants.missing_entries()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_kernels.json")
    args = ap.parse_args()
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device found; run with --cpu-dry-run to exercise the script on a CPU")
    dev = torch.device("cpu" if dry else "cuda")
    ms_of = timer(dry)
    start = time.time()
    dtype = torch.float32 if dry else torch.bfloat16
    report = {"date": datetime.date.today().isoformat(), "dtype": str(dtype), "sections": {},
              "checks": [], "timings": []}

    def save():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_kernels.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)

    def section(name, fn):
        """Run one section; an exception is recorded (ERROR) and the run goes on."""
        t0 = time.time()
        try:
            result = fn()
            report["sections"][name] = {"status": "OK", "seconds": time.time() - t0}
        except Exception as e:  # one broken section must not end a paid-for GPU run
            import traceback
            traceback.print_exc()
            result = None
            report["sections"][name] = {"status": "ERROR", "seconds": time.time() - t0,
                                        "error": f"{type(e).__name__}: {e}"}
            print(f"SECTION {name} ERROR: {type(e).__name__}: {e}", flush=True)
        save()
        return result

    report["versions"] = section("versions", lambda: versions(dev))
    print(f"versions: {report['versions']}", flush=True)
    copy_bw = section("copy_bandwidth", lambda: copy_bandwidth(
        dev, ms_of, (1 << 20) * (4 if dry else 1024))) or float("nan")
    report["copy_GB/s"] = copy_bw / 1e9
    print(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s", flush=True)
    warm_rows, report["warm_up"] = section("warm_up", lambda: warm_up(dev, dry)) or ([], None)
    # the interpreter's bf16 tl.dot is wrong, so the CPU dry run checks fp32 and fp16
    dtypes = [torch.float32, torch.float16] if dry else [torch.float16, torch.bfloat16]
    report["checks"] = warm_rows + (
        section("checks", lambda: cases.run_checks(dtypes, dev, small=dry)) or [])
    decode_shapes = [(2, 64), (1, 1024)] if dry else [(64, 4096), (1, 32768)]
    for b, ctx in decode_shapes:
        report["timings"] += section(f"decode B{b}x{ctx}", lambda: decode_rows(
            dev, dtype, ms_of, dry, copy_bw, b, ctx)) or []
    report["timings"] += section("prefill", lambda: prefill_rows(dev, dtype, ms_of, dry)) or []
    report["timings"] += section("state_updates", lambda: state_rows(
        dev, dtype, ms_of, dry, copy_bw)) or []
    report["timings"] += section("quantized_caches", lambda: gpu_quantized_case.timing_rows(
        dev, ms_of, dry, copy_bw)) or []
    report["timings"] += section("bamba9b_layers", lambda: gpu_layer_case.bamba9b_layer_rows(
        dev, small=dry)) or []
    report["timings"] += section("tiny_bamba_engine", lambda: gpu_model_case.bamba_rows(
        dev, small=dry)) or []
    report["timings"] += section("graph_decode", lambda: gpu_model_case.graph_decode_rows(
        dev, small=dry)) or []
    print_table(copy_bw, report["checks"], report["timings"])
    print(f"device {report['versions'] and report['versions']['device']}, timing dtype {dtype}, "
          f"wall {time.time() - start:.0f} s")
    report["wall_s"] = time.time() - start
    save()
    bad = [c.get("kernel", c.get("case")) for c in report["checks"] + report["timings"]
           if c.get("status") in ("FAIL", "ERROR")]
    broken = [n for n, sec in report["sections"].items() if sec["status"] != "OK"]
    if bad or broken:
        sys.exit(f"{len(bad)} wrong result(s): {', '.join(bad) or '-'}; "
                 f"{len(broken)} section(s) raised: {', '.join(broken) or '-'}")


if __name__ == "__main__":
    main()
