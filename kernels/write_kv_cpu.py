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

from typing import Optional

import torch

from .native_args import I64, CFunction, f32, i64
from .attention_ref import check_write_kv_inputs

# native/rope_write_kv.c, declared parameter by parameter (native_args.py)
ROPE_WRITE_KV = CFunction(
    "rope_write_kv", "rope_write_kv_f32", I64,
    qkv=f32("T", "(Hq + 2 * Hkv) * D", strides=("qkv_stride", 1)), qkv_stride=I64, T=I64, Hq=I64, Hkv=I64,
    D=I64, rot=I64, cos=f32("T", "rot", strides=("cs_stride", 1)), sin=f32("T", "rot", strides=("cs_stride", 1)),
    cs_stride=I64, q_out=f32("T", "Hq", "D", new=True),
    kv=f32("num_blocks", 2, "block_size", "Hkv", "D", strides=("s_block", "s_part", "s_off", "s_head", 1)),
    s_block=I64, s_part=I64, s_off=I64, s_head=I64, slots=i64("T"), block_size=I64, num_blocks=I64)


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
    if not ROPE_WRITE_KV.available():
        return None
    T, D = qkv.shape[0], head_dim
    if (qkv.dtype != torch.float32 or kv_cache.dtype != torch.float32 or not qkv.is_cpu
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
    rot, cos, sin, cs_stride, slots = step
    if rot == 0:  # cos and sin are not read: qkv's first columns stand in (valid addresses)
        cos = sin = qkv[:, :0]
        cs_stride = qkv.stride(0)
    s, (num_blocks, _, bs) = kv_cache.stride(), kv_cache.shape[:3]
    bad, q = ROPE_WRITE_KV.call(qkv=qkv, qkv_stride=qkv.stride(0), T=T, Hq=num_heads, Hkv=num_kv_heads, D=D,
                             rot=rot, cos=cos, sin=sin, cs_stride=cs_stride, kv=kv_cache,
                             s_block=s[0], s_part=s[1], s_off=s[2], s_head=s[3], slots=slots, block_size=bs,
                             num_blocks=num_blocks)
    if bad >= 0:
        raise IndexError(f"slot_mapping[{bad}] = {int(slot_mapping[bad])} lies past the KV pool of "
                         f"{num_blocks} blocks x {bs} slots")
    return q


def _step_args(rope, slot_mapping: torch.Tensor, T: int, D: int) -> tuple:
    """(rot, cos, sin, their row stride, slots), the same for every layer of a step; () when
    the C loop cannot read them (rot 0: no rotary, cos and sin None)."""
    if (slot_mapping.dtype != torch.int64 or not slot_mapping.is_cpu or not slot_mapping.is_contiguous()
            or slot_mapping.shape != (T,)):
        return ()
    if rope is None:
        return 0, None, None, 0, slot_mapping
    cos, sin = rope
    rot = cos.shape[-1]
    if (cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_cpu or not sin.is_cpu
            or cos.dim() != 2 or cos.shape != sin.shape or cos.stride() != sin.stride()
            or cos.stride(1) != 1 or rot % 2 or rot > D or cos.shape[0] != T):
        return ()
    return rot, cos, sin, cos.stride(0), slot_mapping


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
