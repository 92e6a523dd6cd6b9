"""Triton kernel that scatters new tokens' K and V into the paged cache through flat slots."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .attention_ref import check_write_kv_inputs


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv_blk, stride_kv_kv, stride_kv_off, stride_kv_h,
    HEAD_DIM: tl.constexpr, NUM_ELEMS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUM_ELEMS
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=ok)
    dst = (slot // BLOCK_SIZE) * stride_kv_blk + (slot % BLOCK_SIZE) * stride_kv_off \
        + h * stride_kv_h + d
    dtype = kv_ptr.dtype.element_ty
    tl.store(kv_ptr + dst, k.to(dtype), mask=ok)
    tl.store(kv_ptr + stride_kv_kv + dst, v.to(dtype), mask=ok)


def write_kv_triton(k, v, kv_cache, slot_mapping):
    """Triton version of `write_kv_ref`: k, v [T, Hkv, D] into kv_cache [num_blocks, 2, bs, Hkv, D]
    at flat slots slot_mapping [T] (int64; -1 skipped), in place. Returns kv_cache."""
    check_write_kv_inputs(k, v, kv_cache, slot_mapping)
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's head_dim axis must be contiguous (stride 1)")
    t, hkv, d = k.shape
    if t == 0:
        return kv_cache
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    num = hkv * d
    block = min(triton.next_power_of_2(num), 2048)
    grid = (t, triton.cdiv(num, block))
    guard = torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext()
    with guard:
        _write_kv_kernel[grid](
            k, v, kv_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            HEAD_DIM=d, NUM_ELEMS=num, BLOCK_SIZE=kv_cache.shape[2], BLOCK=block,
            num_warps=4,
        )
    return kv_cache
