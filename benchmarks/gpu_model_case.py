"""Whole-model GPU cases for gpu_kernels.py; `small` keeps the CPU dry run short.

- bamba_rows: a tiny Bamba through the whole engine, Triton backend against torch backend (issue
  4's GPU check): same checkpoint, same prompts, greedy; tokens identical in float32.
- graph_decode_rows: a decode step with CUDA graphs on (scheduler/decode_graphs.py) against off,
  at batch 1 and 64 over 512-token contexts, on an 8-layer Bamba-9B-width model with random
  weights: host CPU time of issuing the step (time.process_time) and GPU time (CUDA events),
  alternating on/off, median of 7 with min-max; the graph's logits are checked against the eager
  step's on twin pools. The dry run uses the tiny Bamba and DecodeGraphs' dry-run mode (no
  capture; the Triton kernels interpreted), so its times say nothing about a GPU.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from gpu_layer_case import step_times  # the benchmarks folder is on sys.path (gpu_kernels.py)


def _generate(path, dev, dtype, prompts, max_tokens, backend):
    from hybridkv import LLM, SamplingParams

    os.environ["HYBRIDKV_BACKEND"] = backend
    try:
        # the interpreted dry run profiles start-up at 16 tokens, not 256 (minutes interpreted)
        budget = {} if dev.type == "cuda" else {"max_num_batched_tokens": 16}
        llm = LLM(path, device=dev.type, dtype=dtype, memory_budget_bytes=256 << 20, **budget)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if dev.type == "cuda":  # warm-up: the same shapes with other tokens (no prefix hits), so
            # every shape JIT-compiles before the clock starts (nothing compiles when interpreted)
            other = [[4 + (t - 3) % 124 for t in p] for p in prompts]
            llm.generate(other, params, use_tqdm=False)
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


GRAPH_MODEL_9B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                      attn_layer_indices=[3, 7], num_attention_heads=32, num_key_value_heads=8,
                      mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                      mamba_chunk_size=256, vocab_size=128256, max_position_embeddings=4096)
GRAPH_MODEL_SMALL = dict(num_hidden_layers=2, attn_layer_indices=[1])


def _graph_model(dev, dtype, small):
    """A Bamba model with random weights (Linear / embedding weights N(0, 0.02)) on dev."""
    from hybridkv.models.bamba import BambaModel, tiny_config

    config = tiny_config(**(GRAPH_MODEL_SMALL if small else GRAPH_MODEL_9B))
    torch.manual_seed(0)
    with torch.device(dev):
        model = BambaModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.max_model_len = config.max_position_embeddings
    return model.to(dtype).eval()


def _graph_pools(model, num_blocks, num_slots, bs, dev):
    from hybridkv.models.forward_batch import ModelCaches
    from hybridkv.specs import AttentionSpec

    gen = torch.Generator(device=dev).manual_seed(3)
    kv, conv, state = {}, {}, {}
    for i, spec in model.cache_specs().items():
        if isinstance(spec, AttentionSpec):
            kv[i] = torch.randn(num_blocks, 2, bs, spec.num_kv_heads, spec.head_dim, generator=gen,
                                device=dev).to(spec.dtype)
        else:
            conv[i] = torch.randn(num_slots, *spec.conv_shape, generator=gen, device=dev).to(spec.dtype)
            state[i] = (torch.randn(num_slots, *spec.state_shape, generator=gen, device=dev)
                        * 0.1).to(spec.ssm_dtype)
    return ModelCaches(kv=kv, conv=conv, state=state, block_size=bs)


def _twin(caches):
    from hybridkv.models.forward_batch import ModelCaches

    return ModelCaches(*({i: t.clone() for i, t in d.items()} for d in (caches.kv, caches.conv,
                                                                          caches.state)),
                       block_size=caches.block_size)


def _decode_inputs(batch, context, bs):
    """Requests 0..batch-1 each `context` tokens in (blocks laid out one request after another,
    state slots 1..batch), decoding their next token."""
    from hybridkv.scheduler.decode_graphs import DecodeInputs

    nblk = context // bs + 1
    table = torch.arange(batch * nblk, dtype=torch.int32).view(batch, nblk)
    return DecodeInputs([5 + r % 100 for r in range(batch)], [context] * batch,
                        [int(table[r, context // bs]) * bs + context % bs for r in range(batch)],
                        list(range(1, batch + 1)), table)


def _eager_step(model, caches, inputs, dev):
    """What the engine does without graphs: a ForwardBatch from host lists, then the forward."""
    from hybridkv.models.forward_batch import ForwardBatch

    r = len(inputs.token_ids)
    lens = [p + 1 for p in inputs.positions]
    i32 = dict(dtype=torch.int32, device=dev)
    batch = ForwardBatch(
        input_ids=torch.tensor(inputs.token_ids, dtype=torch.long, device=dev),
        positions=torch.tensor(inputs.positions, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(r + 1, **i32), seq_lens=torch.tensor(lens, **i32),
        block_table=inputs.block_table.to(dev),
        slot_mapping=torch.tensor(inputs.slot_mapping, dtype=torch.long, device=dev),
        state_slots=torch.tensor(inputs.state_slots, **i32),
        has_initial_state=torch.ones(r, dtype=torch.bool, device=dev),
        query_lens_cpu=[1] * r, seq_lens_cpu=lens)
    with torch.inference_mode():
        return model(batch, caches)


def _spread(xs):
    xs = [x for x in xs if x is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def graph_decode_rows(dev: torch.device, small: bool) -> list[dict]:
    """Rows: per batch size, the graph step's check against the eager step, then the decode-step
    CPU and GPU times with graphs off and on."""
    from hybridkv.scheduler.decode_graphs import DecodeGraphs

    dtype = torch.float32 if small else torch.bfloat16
    batches, context, bs, repeats = ((1, 2), 40, 16, 1) if small else ((1, 64), 512, 16, 7)
    model = _graph_model(dev, dtype, small)
    top = max(batches)
    eager = _graph_pools(model, top * (context // bs + 1), top + 1, bs, dev)
    graphed = _twin(eager)
    graphs = DecodeGraphs(model, graphed, max_num_seqs=top, max_model_len=context + bs,
                          block_size=bs, mode="dry_run" if small else "cuda")
    t0 = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t0
    rows, tol = [], TOL_GRAPH[dtype]
    for b in batches:
        inputs = _decode_inputs(b, context, bs)
        want = _eager_step(model, eager, inputs, dev).float()
        got = graphs.run(inputs).float()
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        ok = err < tol and bool(torch.isfinite(got).all())
        rows.append({"case": f"graph decode check, batch {b}", "kernel": f"graph decode B{b}",
                     "rel_err_vs_eager": err, "status": "PASS" if ok else "FAIL",
                     "capture_s": capture_s})
        print(f"graph decode batch {b}: rel err vs eager {err:.1e} ({'PASS' if ok else 'FAIL'})",
              flush=True)
        times = {"off": [], "on": []}
        steps = {"off": lambda: _eager_step(model, eager, inputs, dev), "on": lambda: graphs.run(inputs)}
        for name in ("off", "on"):  # warm-up outside the clock
            steps[name]()
        for _ in range(repeats):  # alternating, so a load change on the host hits both
            for name in ("off", "on"):
                times[name].append(step_times(steps[name], dev))
        for name in ("off", "on"):
            cpu, cpu_lo, cpu_hi = _spread([c for c, _ in times[name]])
            gpu, gpu_lo, gpu_hi = _spread([g for _, g in times[name]])
            rows.append({"case": f"decode step graphs {name}, batch {b}",
                         "ms": gpu if gpu is not None else cpu, "cpu_ms": cpu,
                         "cpu_ms_min_max": [cpu_lo, cpu_hi], "gpu_ms": gpu,
                         "gpu_ms_min_max": [gpu_lo, gpu_hi], "repeats": repeats})
            print(f"decode step graphs {name}, batch {b}: CPU {cpu:.2f} ms [{cpu_lo:.2f}, "
                  f"{cpu_hi:.2f}], GPU {'-' if gpu is None else f'{gpu:.2f} ms [{gpu_lo:.2f}, {gpu_hi:.2f}]'}",
                  flush=True)
    return rows


TOL_GRAPH = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
