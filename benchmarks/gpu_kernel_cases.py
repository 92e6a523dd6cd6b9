"""Inputs and correctness checks for benchmarks/gpu_kernels.py: every Triton kernel against its
torch reference on the same random inputs. A kernel whose module is not there yet is reported
as MISSING, never skipped silently."""
from __future__ import annotations

import importlib
import math

import torch

import gpu_quantized_case
from hybridkv.kernels import (attention_ref, conv1d_ref, gdn_ref, kda_ref, lightning_ref, mamba1_ref,
                              mamba2_ref)

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rel_err(a, b):
    """max|a - b| / max|b| in float32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def triton_fn(module, name):
    """The Triton function `hybridkv.kernels.<module>.<name>`, or None when it does not exist."""
    try:
        return getattr(importlib.import_module(f"hybridkv.kernels.{module}"), name)
    except (ModuleNotFoundError, AttributeError):
        return None


def paged_batch(reqs, bs, hkv, hq, d, dtype, dev, gen):
    """q, kv_cache, query_start_loc, seq_lens, block_table for (query_len, seq_len) requests,
    with blocks handed out in shuffled order."""
    need = [math.ceil(s / bs) for _, s in reqs]
    nblocks = sum(need) + 1
    kv = torch.randn(nblocks, 2, bs, hkv, d, generator=gen, device=dev).to(dtype)
    perm = torch.randperm(nblocks, generator=gen, device=dev).to(torch.int32)
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32, device=dev)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used:used + n]
        used += n
    t = sum(q for q, _ in reqs)
    q = torch.randn(t, hq, d, generator=gen, device=dev).to(dtype)
    qsl = torch.tensor([0] + [q for q, _ in reqs], device=dev).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32, device=dev)
    return q, kv, qsl, seq_lens, table


def _attention(dtype, dev, gen, small, window):
    reqs = ([(1, 17), (5, 33), (16, 16), (1, 1)] if small
            else [(1, 1), (1, 4097), (300, 700), (1, 17), (64, 64), (129, 2000), (1, 255)])
    hkv, hq, d = (2, 8, 64) if small else (8, 32, 128)
    q, kv, qsl, lens, table = paged_batch(reqs, 16, hkv, hq, d, dtype, dev, gen)
    fn = triton_fn("paged_attention_kernel", "paged_attention_triton")
    if fn is None:
        return None
    args = (q, kv, qsl, lens, table, d ** -0.5)
    got = fn(*args, sliding_window=window, max_query_len=max(r[0] for r in reqs))
    return [(got, attention_ref.paged_attention_ref(*args, sliding_window=window))]


def _write_kv(dtype, dev, gen, small):
    t, hkv, d, nblocks = (9, 2, 64, 4) if small else (4096, 8, 128, 512)
    cache = torch.randn(nblocks, 2, 16, hkv, d, generator=gen, device=dev).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen, device=dev).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen, device=dev).to(dtype)
    slots = torch.randperm(nblocks * 16, generator=gen, device=dev)[:t]
    slots[::7] = -1
    fn = triton_fn("write_kv_kernel", "write_kv_triton")
    if fn is None:
        return None
    a, b = cache.clone(), cache.clone()
    fn(k, v, a, slots)
    attention_ref.write_kv_ref(k, v, b, slots)
    return [(a, b)]


def _slot_setup(num, batch, dev, gen):
    slots = torch.randperm(num - 1, generator=gen, device=dev)[:batch].to(torch.int32) + 1
    return slots


def _pair(fn, ref, state, *args, **kw):
    """Run kernel and reference on copies of the pool; compare outputs and the pools."""
    s1, s2 = state.clone(), state.clone()
    y1, y2 = fn(s1, *args, **kw), ref(s2, *args, **kw)
    return [(y1, y2), (s1, s2)]


def _conv(dtype, dev, gen, small, update):
    dim, kw, batch = (32, 4, 3) if small else (8192, 4, 64)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    conv_state, w, bias = r(batch + 2, dim, kw - 1), r(dim, kw), r(dim)
    slots = _slot_setup(batch + 2, batch, dev, gen)
    if update:
        fn = triton_fn("conv1d", "conv1d_update_triton")
        x = r(batch, dim)
        if fn is None:
            return None
        c1, c2 = conv_state.clone(), conv_state.clone()
        y1 = fn(x, c1, w, bias, slots, "silu")
        y2 = conv1d_ref.conv1d_update_ref(x, c2, w, bias, slots, "silu")
        return [(y1, y2), (c1, c2)]
    fn = triton_fn("conv1d", "causal_conv1d_triton")
    lens = [1, 2, 5] if small else [1, 17, 300, 1000]
    lens = (lens * batch)[:batch]
    qsl = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    init = torch.arange(batch, device=dev) % 2 == 0
    x = r(sum(lens), dim)
    if fn is None:
        return None
    c1, c2 = conv_state.clone(), conv_state.clone()
    y1 = fn(x, c1, w, bias, qsl, slots, init, "silu")
    y2 = conv1d_ref.causal_conv1d_ref(x, c2, w, bias, qsl, slots, init, "silu")
    return [(y1, y2), (c1, c2)]


def mamba1_inputs(dtype, dev, gen, batch, d_inner, n):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    state = r(batch + 1, d_inner, n)
    A = -torch.rand(d_inner, n, generator=gen, device=dev).add(0.5).to(dtype)
    args = (r(batch, d_inner), r(batch, d_inner), A, r(batch, n), r(batch, n), r(d_inner),
            r(batch, d_inner), r(d_inner), _slot_setup(batch + 1, batch, dev, gen))
    return state, args


def mamba2_inputs(dtype, dev, gen, batch, h, p, n, g):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    state = r(batch + 1, h, p, n)
    A = -torch.rand(h, generator=gen, device=dev).add(0.5).to(dtype)
    args = (r(batch, h, p), r(batch, h), A, r(batch, g, n), r(batch, g, n), r(h), r(batch, h, p),
            r(h), _slot_setup(batch + 1, batch, dev, gen))
    return state, args


def gdn_inputs(dtype, dev, gen, batch, h, hv, k, v):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    state = r(batch + 1, hv, k, v)
    g = -torch.rand(batch, hv, generator=gen, device=dev).to(dtype)
    beta = torch.rand(batch, hv, generator=gen, device=dev).to(dtype)
    args = (r(batch, h, k), r(batch, h, k), r(batch, hv, v), g, beta,
            _slot_setup(batch + 1, batch, dev, gen))
    return state, args


def lightning_inputs(dtype, dev, gen, batch, h, k, v):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    state = r(batch + 1, h, k, v)
    slope = torch.rand(h, generator=gen, device=dev) * 0.5 + 0.01  # per-head decay rates, fp32
    args = (r(batch, h, k), r(batch, h, k), r(batch, h, v), slope, _slot_setup(batch + 1, batch, dev, gen))
    return state, args


def kda_inputs(dtype, dev, gen, batch, h, k, v):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    state = r(batch + 1, h, k, v)
    g = -torch.rand(batch, h, k, generator=gen, device=dev).to(dtype)  # per-channel log-decay
    beta = torch.rand(batch, h, generator=gen, device=dev).to(dtype)
    args = (r(batch, h, k), r(batch, h, k), r(batch, h, v), g, beta, _slot_setup(batch + 1, batch, dev, gen))
    return state, args


# (small, full): full sizes are Jamba / Mamba2-2.7B / Qwen3-Next / MiniMax-01 / Kimi-Linear
# shaped at batch 256, so a step moves 0.5-4 GB of state (batch 64: ~10 us of work, launch-bound)
STATE_SIZES = {
    "mamba1": ((3, 32, 16), (256, 8192, 16)),
    "mamba2": ((3, 4, 16, 16, 1), (256, 64, 64, 128, 1)),
    "gdn": ((3, 2, 4, 32, 32), (256, 16, 32, 128, 128)),
    "lightning": ((3, 2, 32, 32), (256, 64, 128, 128)),
    "kda": ((3, 2, 32, 32), (256, 32, 128, 128)),
}


def _state(kind, dtype, dev, gen, small):
    sizes = STATE_SIZES[kind][0 if small else 1]
    if kind == "mamba1":
        fn = triton_fn("mamba1", "mamba1_state_update_triton")
        state, args = mamba1_inputs(dtype, dev, gen, *sizes)
        ref = mamba1_ref.mamba1_state_update_ref
    elif kind == "mamba2":
        fn = triton_fn("mamba2", "mamba2_state_update_triton")
        state, args = mamba2_inputs(dtype, dev, gen, *sizes)
        ref = mamba2_ref.mamba2_state_update_ref
    elif kind == "lightning":
        fn = triton_fn("lightning", "lightning_state_update_triton")
        state, args = lightning_inputs(dtype, dev, gen, *sizes)
        ref = lightning_ref.lightning_state_update_ref
    elif kind == "kda":
        fn = triton_fn("kda", "kda_state_update_triton")
        state, args = kda_inputs(dtype, dev, gen, *sizes)
        ref = kda_ref.kda_state_update_ref
    else:
        fn = triton_fn("gdn", "gdn_state_update_triton")
        state, args = gdn_inputs(dtype, dev, gen, *sizes)
        ref = gdn_ref.gdn_state_update_ref
    return None if fn is None else _pair(fn, ref, state, *args)


CHECKS = {
    "paged_attention": lambda dt, dev, g, small: _attention(dt, dev, g, small, None),
    "paged_attention_window": lambda dt, dev, g, small: _attention(dt, dev, g, small, 100),
    "write_kv": _write_kv,
    "causal_conv1d": lambda dt, dev, g, small: _conv(dt, dev, g, small, False),
    "conv1d_update": lambda dt, dev, g, small: _conv(dt, dev, g, small, True),
    "mamba1_state_update": lambda dt, dev, g, small: _state("mamba1", dt, dev, g, small),
    "mamba2_state_update": lambda dt, dev, g, small: _state("mamba2", dt, dev, g, small),
    "gdn_state_update": lambda dt, dev, g, small: _state("gdn", dt, dev, g, small),
    "lightning_state_update": lambda dt, dev, g, small: _state("lightning", dt, dev, g, small),
    "kda_state_update": lambda dt, dev, g, small: _state("kda", dt, dev, g, small),
    **gpu_quantized_case.CHECKS,  # the kernels over quantized caches (int8 / fp8 pools in place)
}


def run_checks(dtypes, dev, small):
    """One row per (kernel, dtype): status PASS / FAIL / MISSING / ERROR and the worst rel err."""
    rows = []
    for name, check in CHECKS.items():
        for dtype in dtypes:
            gen = torch.Generator(device=dev).manual_seed(0)
            row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "tol": TOL[dtype]}
            try:
                pairs = check(dtype, dev, gen, small)
                if pairs is None:
                    row.update(status="MISSING", rel_err=None)
                else:
                    err = max(rel_err(a, b) for a, b in pairs)
                    row.update(status="PASS" if err < TOL[dtype] else "FAIL", rel_err=err)
            except Exception as e:  # one broken kernel must not end a paid-for GPU run
                row.update(status="ERROR", rel_err=None, error=f"{type(e).__name__}: {e}")
            print(f"check {row['kernel']:<24} {row['dtype']:<9} {row['status']:<8} "
                  f"rel_err={row['rel_err']}" + (f"  {row['error']}" if "error" in row else ""),
                  flush=True)
            rows.append(row)
    return rows
