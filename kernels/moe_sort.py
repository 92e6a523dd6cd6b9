"""Routed (token, slot) pairs sorted by expert, with no host sync: the layout of a grouped matmul.

A pair is named by its flat index `t * top_k + j` into `topk_ids [T, top_k]`. Everything here is
built from tensor ops whose output sizes follow from shapes alone (no `.item()`, `.tolist()`,
`unique` or `bincount`, which read device memory to size their output), so a CUDA graph can hold it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids [T, k] -> pairs per expert [E] (int64)."""
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


@dataclass(frozen=True)
class ExpertBlocks:
    """Pairs sorted by expert, each expert's run padded to a multiple of `block`.

    sorted_pairs [P] int32: flat pair index, or `num_pairs` in padding; P is a multiple of `block`
    and bounds the padded total from shapes alone. block_expert [P // block] int32: the expert of
    each block (blocks past `num_padded` are unused). num_padded [1] int32: the padded total.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_pairs: int
    block: int


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block: int) -> ExpertBlocks:
    """topk_ids [T, k] -> ExpertBlocks for a kernel that runs one program per `block` rows."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = expert_counts(topk_ids, num_experts)
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(n, device=dev) - start[expert_of_sorted]
    # at most min(E, n) experts are non-empty, each adds at most block-1 padding rows
    bound = n + min(num_experts, n) * (block - 1)
    size = (bound + block - 1) // block * block
    sorted_pairs = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_pairs[padded_start[expert_of_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block, device=dev)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_expert, padded_end[-1:].to(torch.int32), n, block)
