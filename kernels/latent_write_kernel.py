"""Triton kernel that writes each new token's latent `[c | k_rot]` into the paged LATENT KV.

The spec is `latent_attention_ref.write_latent_ref`; this path skips the -1 slots inside the
kernel (no boolean mask, no read of the slots on the host), so a CUDA graph can hold it. Slots
are trusted, as write_kv_triton trusts its own: bounds-checking them would be a host sync.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _write_latent_kernel(latent_ptr, cache_ptr, slot_ptr, stride_lt, stride_blk, stride_off,
                         DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: writes nothing
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < DIM
    x = tl.load(latent_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok)
    dst = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_off + offs
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=ok)


def write_latent_triton(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, D] into kv_cache [N, 1, bs, 1, D] at flat slots slot_mapping [T] (-1 skipped),
    in place; same contract as write_latent_ref except that slots are not bounds-checked."""
    n, parts, bs, heads, dim = kv_cache.shape
    if parts != 1 or heads != 1 or latent.dim() != 2 or latent.shape[-1] != dim:
        raise ValueError(f"latent {tuple(latent.shape)} does not fit latent pages {tuple(kv_cache.shape)}; "
                         f"expected pages [blocks, 1, block_size, 1, {latent.shape[-1]}]")
    if slot_mapping.shape != (latent.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must hold one slot per latent row "
                         f"({latent.shape[0]})")
    if kv_cache.stride(-1) != 1:
        raise ValueError("the latent pages' last axis must be contiguous (stride 1)")
    if latent.shape[0] == 0:
        return
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    block = min(triton.next_power_of_2(dim), 1024)
    grid = (latent.shape[0], triton.cdiv(dim, block))
    guard = torch.cuda.device(latent.device) if latent.is_cuda else contextlib.nullcontext()
    with guard:
        _write_latent_kernel[grid](latent, kv_cache, slot_mapping, latent.stride(0), kv_cache.stride(0),
                                   kv_cache.stride(2), DIM=dim, BLOCK_SIZE=bs, BLOCK=block, num_warps=4)
