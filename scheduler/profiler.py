"""Start-up measurements the engine plans with: prefill cost per token, peak activations, host link.

They feed the memory budget on a GPU (total x utilization - weights - peak activations) and
the swap-or-recompute cost model of preemption_mode="auto".
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec
from hybridkv.models.forward_batch import ForwardBatch, ModelCaches


@dataclass(frozen=True)
class Profile:
    prefill_seconds_per_token: float
    peak_activation_bytes: int
    host_bytes_per_second: float


def _scratch_caches(specs: dict[int, LayerSpec], num_tokens: int, block_size: int,
                    device: torch.device) -> ModelCaches:
    blocks = -(-num_tokens // block_size) + 1
    kv, conv, state = {}, {}, {}
    for i, s in specs.items():
        if isinstance(s, AttentionSpec):
            kv[i] = torch.zeros(blocks, s.kv_parts, block_size, s.num_kv_heads, s.head_dim,
                                dtype=s.dtype, device=device)
        elif isinstance(s, RecurrentSpec):
            conv[i] = torch.zeros(2, *s.conv_shape, dtype=s.dtype, device=device)
            state[i] = torch.zeros(2, *s.state_shape, dtype=s.ssm_dtype, device=device)
    return ModelCaches(kv=kv, conv=conv, state=state, block_size=block_size)


def _one_prompt_batch(num_tokens: int, block_size: int, vocab: int, device) -> ForwardBatch:
    i32 = dict(dtype=torch.int32, device=device)
    blocks = -(-num_tokens // block_size)
    positions = torch.arange(num_tokens, device=device)
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (num_tokens,), device=device),
        positions=positions,
        query_start_loc=torch.tensor([0, num_tokens], **i32),
        seq_lens=torch.tensor([num_tokens], **i32),
        block_table=torch.arange(1, blocks + 1, **i32)[None],
        slot_mapping=positions + block_size,
        state_slots=torch.tensor([1], **i32),
        has_initial_state=torch.tensor([False], device=device),
        query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_bandwidth(device: torch.device, nbytes: int = 32 << 20) -> float:
    """Bytes/s of one device -> host -> device round trip, halved (the swap path's cost)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        host.copy_(src, non_blocking=True)
        src.copy_(host, non_blocking=True)
    _sync(device)
    return 6 * nbytes / max(time.perf_counter() - t0, 1e-9)


@torch.inference_mode()
def profile_model(model, block_size: int, num_tokens: int = 256,
                  peak_tokens: int | None = None) -> Profile:
    """Time one prefill of `num_tokens` on scratch caches; record peak activations of one of
    `peak_tokens` (default num_tokens), which should be the largest step the scheduler runs
    (max_num_batched_tokens).

    Why two sizes: the time per token is steady from a few hundred tokens, but activations grow
    with the step. The torch chunked SSD of one Bamba-9B Mamba2 layer (128 heads x 64, d_state
    128, chunk 256, bf16) peaks at 165 MiB of temporaries for 256 tokens and 1290 MiB for 2048
    (torch.profiler on CPU, benchmarks/gpu_profile_peak.py): a 256-token profile under-counts a
    2048-token step by ~1.1 GB. Peak bytes are measured on CUDA only (max_memory_allocated);
    on CPU they are 0 and the scratch caches stay at num_tokens.
    """
    device = next(model.parameters()).device
    peak_tokens = max(num_tokens, peak_tokens or num_tokens)
    if device.type != "cuda":
        peak_tokens = num_tokens  # nothing to measure: no scratch KV for a step never run
    caches = _scratch_caches(model.cache_specs(), peak_tokens, block_size, device)
    batch = _one_prompt_batch(num_tokens, block_size, model.vocab_size, device)
    model(batch, caches)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    model(batch, caches)
    _sync(device)
    elapsed = time.perf_counter() - t0
    peak = 0
    if device.type == "cuda":
        big = _one_prompt_batch(peak_tokens, block_size, model.vocab_size, device)
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        model(big, caches)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    return Profile(prefill_seconds_per_token=elapsed / num_tokens, peak_activation_bytes=peak,
                   host_bytes_per_second=host_bandwidth(device))
