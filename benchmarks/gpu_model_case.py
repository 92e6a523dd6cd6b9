"""A tiny Bamba through the whole engine, Triton backend against torch backend (issue 4's GPU check).

Same checkpoint, same prompts, greedy: the tokens must be identical in float32, and the engine
time of both backends is reported. Used by gpu_kernels.py; `small` keeps the CPU dry run short.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch


def _generate(path, dev, dtype, prompts, max_tokens, backend):
    from hybridkv import LLM, SamplingParams

    os.environ["HYBRIDKV_BACKEND"] = backend
    try:
        llm = LLM(path, device=dev.type, dtype=dtype, memory_budget_bytes=256 << 20)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # warm-up: on the GPU a workload of the same shapes with other tokens (no prefix hits),
        # so every shape JIT-compiles before the clock starts; in the interpreted dry run one
        # short request (nothing compiles there)
        other = [[4 + (t - 3) % 124 for t in p] for p in prompts]
        warm = (other, params) if dev.type == "cuda" else (
            prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))
        llm.generate(*warm, use_tqdm=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    finally:
        os.environ.pop("HYBRIDKV_BACKEND", None)
    return [o.outputs[0].token_ids for o in outs], secs


def bamba_rows(dev: torch.device, small: bool) -> list[dict]:
    """Rows for the timing table: check + time of the tiny Bamba engine per backend."""
    from hybridkv.models.tiny import make_tiny_checkpoint

    n, lo, hi, new = (2, 3, 9, 2) if small else (16, 32, 200, 32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 128, (int(torch.randint(lo, hi, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(n)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = str(make_tiny_checkpoint("bamba", d))
        ref, t_ref = _generate(path, dev, "float32", prompts, new, "torch")
        tri, t_tri = _generate(path, dev, "float32", prompts, new, "triton")
        same = ref == tri
        rows.append({"case": "tiny Bamba engine fp32, torch backend", "ms": t_ref * 1e3})
        rows.append({"case": "tiny Bamba engine fp32, triton backend", "ms": t_tri * 1e3,
                     "tokens_identical": same, "status": "PASS" if same else "FAIL"})
    print(f"tiny Bamba engine: triton tokens {'==' if same else '!='} torch tokens; "
          f"torch {t_ref:.2f} s, triton {t_tri:.2f} s", flush=True)
    return rows
