"""Contiguous pre-allocation, the baseline paging is measured against, and per-request capacity.

A contiguous server (HF generate, early FasterTransformer) reserves `max_model_len` tokens of KV
for every admitted request, however short it turns out. Our paged manager with one block of
`max_model_len` tokens per request is exactly that reservation, so the baseline runs through the
same manager, scheduler and engine: `LLM(path, **contiguous_llm_kwargs(max_model_len))`.

    bytes_per_request(specs, 4096)               KV of 4096 tokens (paged) + one state slot
    max_concurrent_requests(specs, budget, 4096)  how many such requests fit in `budget` bytes
    pool_utilization(manager)                    (tokens held, tokens reserved) of running requests
"""
from __future__ import annotations

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.plan import kv_bytes_per_request, state_bytes_per_slot, split_specs


def contiguous_llm_kwargs(max_model_len: int) -> dict:
    """LLM keyword arguments for the contiguous baseline: one `max_model_len`-token block per
    request (the whole reservation at admission); prefix caching off, as in such servers."""
    return {"block_size": max_model_len, "max_model_len": max_model_len, "enable_prefix_caching": False}


def contiguous_manager(specs, budget_bytes: int, max_model_len: int, max_num_seqs: int = 256,
                       **kwargs) -> HybridCacheManager:
    """A HybridCacheManager that reserves `max_model_len` contiguous tokens per request."""
    return HybridCacheManager.from_budget(specs, budget_bytes, max_model_len, max_num_seqs, 0.0,
                                          enable_prefix_caching=False, checkpoint_policy="none", **kwargs)


def bytes_per_request(specs, context_len: int, block_size: int = 16) -> int:
    """Bytes one request of `context_len` tokens holds: its KV blocks (rounded up to whole blocks;
    a sliding-window layer only its window's) in every attention layer plus one state slot over
    all recurrent layers."""
    rec = split_specs(specs)[1]
    return kv_bytes_per_request(specs, context_len, block_size) + (state_bytes_per_slot(specs) if rec else 0)


def max_concurrent_requests(specs, budget_bytes: int, context_len: int, block_size: int = 16) -> int:
    """How many requests of `context_len` tokens fit in `budget_bytes` at once (recurrent models
    also keep the null slot 0). With block_size = max_model_len this is the contiguous baseline."""
    per = bytes_per_request(specs, context_len, block_size)
    null = state_bytes_per_slot(specs) if split_specs(specs)[1] else 0
    return max(0, (budget_bytes - null) // per)


def pool_utilization(manager: HybridCacheManager) -> tuple[int, int]:
    """(tokens held, tokens reserved) over running requests: computed tokens against the tokens
    their block tables cover (a shared block counts for each holder). Ratio = 1 - internal
    fragmentation; 1.0 for paging would mean no block is partly empty."""
    held = reserved = 0
    for r in manager.requests.values():
        ids = manager.block_ids(r.request_id)
        first = next((i for i, b in enumerate(ids) if b >= 0), len(ids))  # blocks that left a window
        if len(ids) > first:
            held += r.num_computed_tokens - first * manager.block_size
            reserved += (len(ids) - first) * manager.block_size
    return held, reserved
