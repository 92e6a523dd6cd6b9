"""Split-KV decode (flash-decoding): when to split a request's keys, and the pass that merges.

A decode batch gives paged attention one program per (request, KV head): batch 1 x 8 KV heads is
8 programs on a 132-SM H100/H200, each walking the whole context alone. Splitting the keys of each
request into S shares gives S times the programs; each writes its share's normalised output and
log-sum-exp, and `merge_splits` combines them exactly (a softmax over the union of the shares).

The rule (`kv_splits`): split only decode-only batches (max_query_len == 1: prefill tiles already
fill the GPU) whose grid is smaller than the GPU (num_reqs x kv_heads < num_sms) and whose keys
are long (max_seq_len >= MIN_KEYS_PER_SPLIT x 2). Then S = enough programs for about two waves,
cdiv(2 x num_sms, num_reqs x kv_heads), but never fewer than MIN_KEYS_PER_SPLIT keys a share and
never more than MAX_SPLITS. Example, H200 (132 SMs), 8 KV heads: batch 1 x 32k -> 32 splits;
batch 4 x 4k -> 8 splits; batch 64 x 4k -> 1 (512 programs already).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_math import device_guard

MIN_KEYS_PER_SPLIT = 512  # a share shorter than this costs more in the merge than it saves
MAX_SPLITS = 32
DEFAULT_NUM_SMS = 132  # H100 / H200: the rule's input when no CUDA device says otherwise


def kv_splits(num_reqs: int, kv_heads: int, max_query_len: int | None, max_seq_len: int | None,
              num_sms: int = DEFAULT_NUM_SMS) -> int:
    """How many key shares per request (1: no split); see the module docstring for the rule.

    max_seq_len is the longest span of keys any query attends (seq_len, or the window when one
    is set); unknown lengths (None) mean no split, since finding them would need a host sync.
    """
    if max_query_len is None or max_seq_len is None or max_query_len != 1:
        return 1
    programs = num_reqs * kv_heads
    if programs >= num_sms or max_seq_len < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    want = -(-2 * num_sms // programs)
    return max(1, min(want, max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


@triton.jit
def _merge_splits_kernel(out_ptr, part_ptr, lse_ptr, num_splits, stride_ot, stride_oh,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0))  # 0 for shares that saw no key
    part = tl.load(part_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def merge_splits(out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] <- the lse-weighted mean of part [T, H, S, D] (fp32, each share normalised)
    with weights exp2(lse [T, H, S]) (log2 units; -inf for a share that saw no key). Returns out."""
    t, h, splits, d = part.shape
    if t == 0:
        return out
    with device_guard(out):
        _merge_splits_kernel[(t, h)](
            out, part, lse, splits, out.stride(0), out.stride(1), part.stride(0),
            part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
            S_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out
