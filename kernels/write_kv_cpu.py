"""Fast torch path for the KV write on CPU: same contract as `attention_ref.write_kv_ref`.

K and V of every token go in with one `index_copy_` into the pool viewed as rows
`[num_blocks * 2 * block_size, Hkv, D]` (a non-contiguous pool: one indexed write), and the
step's row indices are worked out once and shared by every attention layer of the step
through `plan_cache` (ForwardBatch.kernel_plans). Checked against the reference in
tests/kernels/test_attention_cpu.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention_ref import check_write_kv_inputs


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
