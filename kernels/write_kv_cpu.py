"""Fast torch path for the KV write on CPU: same contract as `attention_ref.write_kv_ref`.

K and V of a token go in with one indexed write (`kv_cache[block, :, offset] = [k, v]`), and the
step's block / offset indices are worked out once and shared by every attention layer of the step
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
    key = ("write_kv", bs)
    where = None if plan_cache is None else plan_cache.get(key)
    if where is None:
        slots = slot_mapping.long()
        keep = (slots >= 0).nonzero().squeeze(1)
        keep = None if keep.numel() == slots.numel() else keep
        slots = slots if keep is None else slots[keep]
        where = (keep, slots // bs, slots % bs)
        if plan_cache is not None:
            plan_cache[key] = where
    keep, blk, off = where
    kv = torch.stack((k, v), 1)  # [T, 2, Hkv, D]
    kv_cache[blk, :, off] = (kv if keep is None else kv[keep]).to(kv_cache.dtype)
    return kv_cache
