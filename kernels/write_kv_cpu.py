"""Fast torch path for the KV write on CPU: same contract as `attention_ref.write_kv_ref`.

K and V of every token go in with one `index_copy_` into the pool viewed as rows
`[num_blocks * 2 * block_size, Hkv, D]` (a non-contiguous pool: one indexed write), and the
step's row indices are worked out once and shared by every attention layer of the step
through `plan_cache` (ForwardBatch.kernel_plans). Checked against the reference in
tests/kernels/test_attention_cpu.py.

`rope_write_kv_cpu` is the layer's whole step between its q/k/v projection and attention as one C
loop (kernels/native/rope_write_kv.c): rotary on q and k, q out, k and v into the pool; ~12 torch
calls become one. Checked against apply_rotary + write_kv_ref in tests/kernels/test_write_kv.py.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native_cpu
from .attention_ref import check_write_kv_inputs

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ROPE_WRITE_KV_ARGS = [_P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _I, _I]
_rope_write_kv = []  # [the C function or None], looked up at first use


def rope_write_kv_cpu(qkv: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]], num_heads: int,
                      num_kv_heads: int, head_dim: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      plan_cache: Optional[dict] = None) -> Optional[torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) * D] (q heads, k heads, v heads; rows may be strided), rope (cos, sin)
    [T, rot] or None -> q [T, Hq, D] rotated, with k (rotated) and v written into kv_cache
    [num_blocks, 2, bs, Hkv, D] at slot_mapping [T] (-1 skipped), in place. plan_cache: a dict
    living for one step, where the checks of rope and slot_mapping are kept for the next layers.

    None when the C loop does not apply (not CPU float32, native kernels off or unbuilt): the
    caller then runs apply_rotary and write_kv.
    """
    if not native_cpu.enabled():
        return None
    if not _rope_write_kv:
        _rope_write_kv.append(native_cpu.function("rope_write_kv", "rope_write_kv_f32", _ROPE_WRITE_KV_ARGS,
                                                  restype=ctypes.c_int64))
    fn = _rope_write_kv[0]
    T, D = qkv.shape[0], head_dim
    if (fn is None or qkv.dtype != torch.float32 or kv_cache.dtype != torch.float32 or not qkv.is_cpu
            or not kv_cache.is_cpu or qkv.dim() != 2 or qkv.stride(1) != 1 or kv_cache.stride(4) != 1
            or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D or kv_cache.shape[3:] != (num_kv_heads, D)
            or qkv.requires_grad):
        return None
    key = ("rope_write_kv", id(rope), id(slot_mapping), T, D)
    step = None if plan_cache is None else plan_cache.get(key)
    if step is None:
        step = _step_args(rope, slot_mapping, T, D)
        if plan_cache is not None:
            plan_cache[key] = step
    if not step:
        return None
    rot, cos_ptr, sin_ptr, cs_stride, slots_ptr = step
    q = torch.empty((T, num_heads, D))
    s, (num_blocks, _, bs) = kv_cache.stride(), kv_cache.shape[:3]
    bad = fn(qkv.data_ptr(), qkv.stride(0), T, num_heads, num_kv_heads, D, rot, cos_ptr, sin_ptr,
             cs_stride, q.data_ptr(), kv_cache.data_ptr(), s[0], s[1], s[2], s[3], slots_ptr, bs, num_blocks)
    if bad >= 0:
        raise IndexError(f"slot_mapping[{bad}] = {int(slot_mapping[bad])} lies past the KV pool of "
                         f"{num_blocks} blocks x {bs} slots")
    return q


def _step_args(rope, slot_mapping: torch.Tensor, T: int, D: int) -> tuple:
    """(rot, cos ptr, sin ptr, their row stride, slots ptr), the same for every layer of a step;
    () when the C loop cannot read them."""
    if (slot_mapping.dtype != torch.int64 or not slot_mapping.is_cpu or not slot_mapping.is_contiguous()
            or slot_mapping.shape != (T,)):
        return ()
    if rope is None:  # rot 0: cos and sin are not read (any valid address will do)
        return 0, slot_mapping.data_ptr(), slot_mapping.data_ptr(), 0, slot_mapping.data_ptr()
    cos, sin = rope
    rot = cos.shape[-1]
    if (cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_cpu or not sin.is_cpu
            or cos.dim() != 2 or cos.shape != sin.shape or cos.stride() != sin.stride()
            or cos.stride(1) != 1 or rot % 2 or rot > D or cos.shape[0] != T):
        return ()
    return rot, cos.data_ptr(), sin.data_ptr(), cos.stride(0), slot_mapping.data_ptr()


def write_kv_cpu(k, v, kv_cache, slot_mapping, plan_cache: Optional[dict] = None):
    """k, v [T, Hkv, D] into kv_cache [num_blocks, 2, bs, Hkv, D] at flat slots slot_mapping [T]
    (-1 skipped), in place; returns kv_cache. plan_cache: a dict living for one step."""
    check_write_kv_inputs(k, v, kv_cache, slot_mapping)
    bs = kv_cache.shape[2]
    key = ("write_kv", bs, kv_cache.is_contiguous())
    where = None if plan_cache is None else plan_cache.get(key)
    if where is None:
        slots = slot_mapping.long()
        keep = (slots >= 0).nonzero().squeeze(1)
        keep = None if keep.numel() == slots.numel() else keep
        slots = slots if keep is None else slots[keep]
        blk, off = slots // bs, slots % bs
        if key[2]:  # rows of the pool viewed as [num_blocks * 2 * bs, Hkv, D]: K rows, then V rows
            row = blk * (2 * bs) + off
            where = (keep, torch.cat((row, row + bs)))
        else:
            where = (keep, blk, off)
        if plan_cache is not None:
            plan_cache[key] = where
    keep = where[0]
    if keep is not None:
        k, v = k[keep], v[keep]
    if len(where) == 2:  # one index_copy_ of K and V together
        kv_cache.view(-1, *kv_cache.shape[3:]).index_copy_(0, where[1], torch.cat((k, v)).to(kv_cache.dtype))
    else:
        kv_cache[where[1], :, where[2]] = torch.stack((k, v), 1).to(kv_cache.dtype)  # [T, 2, Hkv, D]
    return kv_cache
