"""One Mamba2 layer and one attention layer at Bamba-9B width, random weights (issue 13 item 6).

Bamba-9B: hidden 4096; Mamba2 128 heads x 64, 1 group, d_state 128, conv 4, chunk 256; attention
32 q heads, 8 KV heads, head dim 128; block size 16. Per part:
- prefill of one 4096-token prompt: Triton backend against the torch backend on the same GPU
  (outputs must agree: the check), GPU time of each;
- a decode step at batch 1 and 64 over 4096-token contexts: GPU time (CUDA events) against the
  host CPU time of issuing the step (time.process_time, no sync inside), median of 5 after a
  warm-up. CPU time above GPU time means the step is launch-bound (what CUDA graphs fix).
`small` (the CPU dry run) shrinks every width and runs both backends on the CPU (Triton
interpreted).
"""
from __future__ import annotations

import math
import os
import statistics
import time

import torch

BAMBA_9B = dict(hidden=4096, m_heads=128, m_head_dim=64, groups=1, d_state=128, chunk=256,
                q_heads=32, kv_heads=8, head_dim=128, prompt=4096, context=4096, batches=(1, 64))
SMALL = dict(hidden=64, m_heads=4, m_head_dim=16, groups=1, d_state=16, chunk=16,
             q_heads=4, kv_heads=2, head_dim=16, prompt=40, context=40, batches=(1, 3))
TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def _layers(w, dev, dtype):
    from hybridkv.models.attention import PagedAttention
    from hybridkv.models.mamba2_mixer import Mamba2Mixer

    torch.manual_seed(0)
    mixer = Mamba2Mixer(w["hidden"], w["m_heads"], w["m_head_dim"], w["groups"], w["d_state"], 4,
                        w["chunk"], 1e-5)
    with torch.no_grad():  # Bamba-like: A in [1, 16], dt_bias near softplus^-1 of 0.01..0.1
        mixer.A_log.copy_(torch.log(torch.rand(w["m_heads"]) * 15 + 1))
        mixer.dt_bias.copy_(torch.rand(w["m_heads"]) * 2 - 4)
        mixer.D.normal_()
    attn = PagedAttention(w["hidden"], w["q_heads"], w["kv_heads"], w["head_dim"])
    return mixer.to(dev, dtype).eval(), attn.to(dev, dtype).eval()


def _batch(lens, contexts, dev, bs=16):
    """A ForwardBatch of requests r with lens[r] new tokens on top of contexts[r] cached ones."""
    from hybridkv.models.forward_batch import ForwardBatch

    seq = [c + n for c, n in zip(contexts, lens)]
    nblk = [math.ceil(s / bs) for s in seq]
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    first, slots = 1, []
    for r, n in enumerate(nblk):
        table[r, :n] = torch.arange(first, first + n)
        pos = torch.arange(contexts[r], seq[r])
        slots.append(table[r, pos // bs].long() * bs + pos % bs)
        first += n
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    t = sum(lens)
    b = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long), positions=torch.cat(
            [torch.arange(c, s) for c, s in zip(contexts, seq)]),
        query_start_loc=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32), block_table=table,
        slot_mapping=torch.cat(slots), state_slots=torch.arange(1, len(lens) + 1,
                                                                dtype=torch.int32),
        has_initial_state=torch.tensor([c > 0 for c in contexts]),
        query_lens_cpu=list(lens), seq_lens_cpu=seq)
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table",
                 "slot_mapping", "state_slots", "has_initial_state"):
        setattr(b, name, getattr(b, name).to(dev))
    return b, first


def _pools(w, mixer, reqs, blocks, dev, dtype, gen):
    conv = torch.randn(reqs + 1, mixer.conv_dim, 3, generator=gen, device=dev).to(dtype)
    ssm = torch.randn(reqs + 1, w["m_heads"], w["m_head_dim"], w["d_state"], generator=gen,
                      device=dev).to(dtype) * 0.1
    kv = torch.randn(blocks, 2, 16, w["kv_heads"], w["head_dim"], generator=gen,
                     device=dev).to(dtype)
    return conv, ssm, kv


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _run_part(part, mixer, attn, hidden, batch, pools, fresh=False):
    """One layer call; `fresh` runs on copies of the pools (the check: same inputs per backend),
    else in place (the timings: a decode step updates its states, as in serving)."""
    conv, ssm, kv = (p.clone() for p in pools) if fresh else pools
    with torch.no_grad():
        if part == "mamba2":
            return mixer(hidden, batch, conv, ssm)
        return attn(hidden, None, batch, kv)


def step_times(fn, dev):
    """(host CPU ms of issuing fn (process_time, no sync inside), GPU ms by CUDA events or None)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    c0 = time.process_time()
    fn()
    cpu = (time.process_time() - c0) * 1e3
    if dev.type != "cuda":
        return cpu, None
    end.record()
    torch.cuda.synchronize()
    return cpu, start.elapsed_time(end)


def _gpu_and_cpu_ms(fn, dev, repeats=5):
    """(GPU ms by CUDA events or None on CPU, host CPU ms by process_time), medians."""
    fn()
    cpu, gpu = zip(*(step_times(fn, dev) for _ in range(repeats)))
    gpu = [g for g in gpu if g is not None]
    return (statistics.median(gpu) if gpu else None), statistics.median(cpu)


def bamba9b_layer_rows(dev: torch.device, small: bool) -> list[dict]:
    """Rows: per part, prefill check + times, decode step GPU vs CPU time at each batch size."""
    w = SMALL if small else BAMBA_9B
    dtype = torch.float32 if small else torch.bfloat16
    mixer, attn = _layers(w, dev, dtype)
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    batch, blocks = _batch([w["prompt"]], [0], dev)
    hidden = torch.randn(w["prompt"], w["hidden"], generator=gen, device=dev).to(dtype)
    pools = _pools(w, mixer, 1, blocks, dev, dtype, gen)
    for part in ("mamba2", "attention"):
        out = {}
        for backend in ("torch", "triton"):
            os.environ["HYBRIDKV_BACKEND"] = backend
            try:
                out[backend] = _run_part(part, mixer, attn, hidden, batch, pools, fresh=True)
                gpu_ms, cpu_ms = _gpu_and_cpu_ms(
                    lambda: _run_part(part, mixer, attn, hidden, batch, pools), dev,
                    1 if small else 3)
            finally:
                os.environ.pop("HYBRIDKV_BACKEND", None)
            rows.append({"case": f"B9B {part} prefill {w['prompt']} tok, {backend}",
                         "ms": gpu_ms if gpu_ms is not None else cpu_ms, "cpu_ms": cpu_ms})
        err = _rel(out["triton"], out["torch"])
        ok = err < TOL[dtype] and bool(torch.isfinite(out["triton"]).all())
        rows[-1].update(rel_err_vs_torch=err, status="PASS" if ok else "FAIL",
                        kernel=f"B9B {part} prefill")
        print(f"B9B {part} prefill: triton vs torch rel err {err:.1e} "
              f"({'PASS' if ok else 'FAIL'})", flush=True)
    for bsz in w["batches"]:
        batch, blocks = _batch([1] * bsz, [w["context"]] * bsz, dev)
        hidden = torch.randn(bsz, w["hidden"], generator=gen, device=dev).to(dtype)
        pools = _pools(w, mixer, bsz, blocks, dev, dtype, gen)
        for part in ("mamba2", "attention"):
            gpu_ms, cpu_ms = _gpu_and_cpu_ms(
                lambda: _run_part(part, mixer, attn, hidden, batch, pools), dev, 2 if small else 5)
            rows.append({"case": f"B9B {part} decode step, batch {bsz}",
                         "ms": gpu_ms if gpu_ms is not None else cpu_ms, "cpu_ms": cpu_ms,
                         "gpu_ms": gpu_ms})
    return rows
