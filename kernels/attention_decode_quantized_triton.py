"""One-token decodes of paged attention over a quantized KV pool in Triton, read and written in place
(ops.quantized_decode_attention on CUDA; the CPU's is attention_decode_quantized.py, in C).

The pool keeps each token's key and value vector of a head as one-byte codes and a float32 scale
(hybridkv/cache_dtype.py): `[num_blocks, 2, bs, Hkv, nbytes]` uint8. A program owns one request and
one KV head, its GROUP query heads riding along as the rows of a [BLOCK_M, D] tile (as in
paged_attention_kernel.py). It first encodes the request's new K and V of its head (`fresh`, fp32)
into the pool at the token's slot, the bytes QuantLayout.encode gives them (quant_rows_triton.py),
then attends: the new token from `fresh` at full precision, every earlier key and value from the
pool's codes decoded on read (code x scale, fp32), TILE_N keys a tile through the block table,
online softmax in fp32 with the options of paged attention (GQA, sliding window, soft cap, sinks).
The slot it writes is the request's last position, which it never reads from the pool, so the
write and the reads do not race. The arithmetic is paged_attention_ref's on the decoded pages,
up to the order of fp32 sums (tests/kernels/test_attention_decode_quantized_triton.py).

Split-KV (flash-decoding, split_kv.py's rule) when the grid is smaller than the GPU: program z of a
request walks its share of the pool's keys (share 0 also writes and reads the new token and adds the
sink) and writes a normalised partial output and its log-sum-exp, which split_kv.merge_splits
combines. The keys' span is bounded from the block table's width (or the window): no host sync.
Block ids and slots are not range-checked here either (the CPU kernel's check would cost a sync per
layer); the scheduler hands out ids inside the pool.
The key loop is a counted `for` when compiled and a `while` under TRITON_INTERPRET (triton_math).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .quant_rows_triton import decode_codes, encode_codes, fp8_values_on, row_amax, row_scale
from .split_kv import DEFAULT_NUM_SMS, kv_splits, merge_splits
from .triton_math import device_guard, fold_sink, interpreted, tanh

LOG2E = tl.constexpr(1.4426950408889634)
FORCE_SPLITS = None  # a key-share count to use instead of split_kv's rule (a test sets one)


@triton.jit
def _logits(s, scale, soft_cap, USE_SOFTCAP: tl.constexpr):
    """Raw q.k -> the softmax's logits in log2 units."""
    s = s * scale
    if USE_SOFTCAP:
        s = soft_cap * tanh(s / soft_cap)
    return s * LOG2E


@triton.jit
def _quantized_decode_kernel(
    out_ptr, q_ptr, fresh_ptr, pool_ptr, pool_scale_ptr, fp8_values_ptr, slot_ptr, table_ptr, seq_lens_ptr,
    sinks_ptr, lse_ptr, scale, soft_cap, window, tiles_per_split, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_os, stride_lt, stride_lh, stride_ft, stride_bt, HKV: tl.constexpr, NBYTES: tl.constexpr, CODE_BYTES: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, FP8: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr, SPLIT: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)  # its share of the pool's keys; share 0 also writes and reads the new token
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    TOP: tl.constexpr = 448.0 if FP8 else 127.0
    SCALE_AT: tl.constexpr = CODE_BYTES // 4  # the scale's float32 index in an item
    ITEM_F32: tl.constexpr = NBYTES // 4
    PART: tl.constexpr = BLOCK_SIZE * HKV  # items from a block's keys to its values

    # the new K and V of head h ([2, D]: rows), encoded into the pool at the token's slot
    part = tl.arange(0, 2)
    new = tl.load(fresh_ptr + r.to(tl.int64) * stride_ft + (part[:, None] * HKV + h) * HEAD_DIM + offs_d[None, :],
                  mask=d_ok[None, :], other=0.0)
    amax, bad = row_amax(new, 1)
    new_scale, inv = row_scale(amax, bad, TOP)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    item = ((slot // BLOCK_SIZE) * 2 * BLOCK_SIZE + slot % BLOCK_SIZE) * HKV + h + part * PART
    first = (part * 0 + split) == 0  # (a vector: the interpreter's bool & 0-d bool is no mask)
    tl.store(pool_ptr + item[:, None] * NBYTES + offs_d[None, :], encode_codes(new, inv[:, None], FP8),
             mask=first[:, None] & d_ok[None, :])
    tl.store(pool_scale_ptr + item * ITEM_F32 + SCALE_AT, new_scale, mask=first)
    k_new = tl.sum(tl.where(part[:, None] == 0, new, 0.0), 0)
    v_new = tl.sum(tl.where(part[:, None] == 1, new, 0.0), 0)

    # the new token opens share 0's online softmax: it is always visible
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP
    head = h * GROUP + offs_m
    q = tl.load(q_ptr + r.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.where(split == 0, _logits(tl.sum(q * k_new[None, :], 1), scale, soft_cap, USE_SOFTCAP), float("-inf"))
    l_i = tl.where(split == 0, tl.full([BLOCK_M], 1.0, tl.float32), 0.0)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32) + tl.where(split == 0, v_new, 0.0)[None, :]

    last = tl.load(seq_lens_ptr + r) - 1  # the new token's position; the pool holds 0 .. last - 1
    kv_start = last * 0
    if USE_WINDOW:
        kv_start = tl.maximum(last - window + 1, 0)
    bt_row = table_ptr + r.to(tl.int64) * stride_bt
    tile_lo = kv_start // TILE_N + split * tiles_per_split
    tile_hi = tl.minimum(tl.cdiv(last, TILE_N), tile_lo + tiles_per_split)
    if WHILE_LOOP:
        tile = tile_lo
        while tile < tile_hi:
            m_i, l_i, acc = _attend_tile(
                tile, m_i, l_i, acc, q, row_ok, offs_d, d_ok, pool_ptr, pool_scale_ptr, fp8_values_ptr, bt_row,
                h, kv_start, last, scale, soft_cap, HKV, NBYTES, SCALE_AT, ITEM_F32, PART, BLOCK_SIZE, TILE_N, FP8,
                USE_SOFTCAP)
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            m_i, l_i, acc = _attend_tile(
                tile, m_i, l_i, acc, q, row_ok, offs_d, d_ok, pool_ptr, pool_scale_ptr, fp8_values_ptr, bt_row,
                h, kv_start, last, scale, soft_cap, HKV, NBYTES, SCALE_AT, ITEM_F32, PART, BLOCK_SIZE, TILE_N, FP8,
                USE_SOFTCAP)
    if USE_SINKS:  # the head's sink logit joins the denominator once (share 0), with no value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        sink = tl.where(split == 0, sink, float("-inf"))
        m_i, l_i, acc = fold_sink(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = r.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off + split * stride_os, out, mask=row_ok[:, None] & d_ok[None, :])
    if SPLIT:  # the share's log-sum-exp (log2 units; -inf when it saw no key) for split_kv.merge_splits
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + r.to(tl.int64) * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _attend_tile(tile, m_i, l_i, acc, q, row_ok, offs_d, d_ok, pool_ptr, pool_scale_ptr, fp8_values_ptr, bt_row,
                 h, kv_start, kv_end, scale, soft_cap, HKV: tl.constexpr, NBYTES: tl.constexpr,
                 SCALE_AT: tl.constexpr, ITEM_F32: tl.constexpr, PART: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TILE_N: tl.constexpr, FP8: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    """One TILE_N-key tile of pool keys in [kv_start, kv_end), decoded on read: the updated (m_i, l_i, acc)."""
    key = tile * TILE_N + tl.arange(0, TILE_N)
    key_ok = (key >= kv_start) & (key < kv_end)  # keys outside are never loaded (their blocks may be gone)
    blk = tl.load(bt_row + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    item = (blk * 2 * BLOCK_SIZE + key % BLOCK_SIZE) * HKV + h  # the key's item; its value's is PART on
    k_scale = tl.load(pool_scale_ptr + item * ITEM_F32 + SCALE_AT, mask=key_ok, other=0.0)
    k_codes = tl.load(pool_ptr + item[None, :] * NBYTES + offs_d[:, None], mask=key_ok[None, :] & d_ok[:, None],
                      other=0)
    k = decode_codes(k_codes, k_scale[None, :], fp8_values_ptr, FP8)  # [D_PAD, TILE_N]
    s = _logits(tl.dot(q, k, input_precision="ieee"), scale, soft_cap, USE_SOFTCAP)
    s = tl.where(key_ok[None, :] & row_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a share that has seen no key yet: no inf - inf
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_item = item + PART
    v_scale = tl.load(pool_scale_ptr + v_item * ITEM_F32 + SCALE_AT, mask=key_ok, other=0.0)
    v_codes = tl.load(pool_ptr + v_item[:, None] * NBYTES + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :],
                      other=0)
    v = decode_codes(v_codes, v_scale[:, None], fp8_values_ptr, FP8)  # [TILE_N, D_PAD]
    return m_new, l_i, acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")


def _config(d_pad: int) -> tuple[int, int]:
    """(TILE_N, num_warps) for a padded head dim: fp32 tiles that fit sm_90's registers (ptxas for
    sm_90a: 190 / 250 registers and no spill at head dim 64 / 128; 512 B of spills at 256)."""
    return (64, 4) if d_pad <= 64 else (32, 8) if d_pad <= 128 else (16, 8)


def quantized_decode_attention_triton(q: torch.Tensor, fresh: torch.Tensor, pool: torch.Tensor, layout,
                                      slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                      scale: float, soft_cap: Optional[float], sliding_window: Optional[int],
                                      sinks: Optional[torch.Tensor], plan_cache: dict) -> Optional[torch.Tensor]:
    """ops.quantized_decode_attention in Triton: request r's query q[r] ([R, Hq, D], fp32 / fp16 / bf16)
    and new K/V fresh[r] ([R, 2, 1, Hkv, D] fp32, its token at position seq_lens[r] - 1) -> out
    [R, Hq, D] fp32, the new K/V encoded into pool ([num_blocks, 2, bs, Hkv, nbytes] uint8, contiguous)
    at slot_mapping[r] (every slot >= 0), the keys read through block_table [R, W]. None, nothing
    written, when the inputs are not ones it takes (not one device, pool or layout of another shape,
    head_dim over 256, fresh not fp32 contiguous). plan_cache: unused (the op's signature)."""
    R, hq, d = q.shape
    if not (pool.dtype == torch.uint8 and pool.dim() == 5 and pool.is_contiguous() and pool.shape[1] == 2
            and len(layout.shape) == 1 and layout.shape[0] == d and pool.shape[-1] == layout.nbytes
            and layout.dtype in ("int8", "fp8_e4m3") and d <= 256 and hq % pool.shape[3] == 0
            and fresh.dtype == torch.float32 and fresh.is_contiguous() and tuple(fresh.shape) == (R, 2, 1, pool.shape[3], d)
            and q.is_floating_point() and q.stride(-1) == 1
            and all(t.device == pool.device for t in (q, fresh, slot_mapping, block_table, seq_lens))):
        return None
    out = torch.empty(R, hq, d, dtype=torch.float32, device=q.device)
    if R == 0:
        return out
    hkv, bs = pool.shape[3], pool.shape[2]
    group = hq // hkv
    fp8 = layout.dtype == "fp8_e4m3"
    d_pad = max(16, triton.next_power_of_2(d))
    tile_n, num_warps = _config(d_pad)
    table = block_table if block_table.dtype == torch.int32 and block_table.stride(1) == 1 else \
        block_table.to(torch.int32).contiguous()
    sink = None if sinks is None else sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
    # the most keys a request reads, from shapes alone (no host sync): its table's width, or its window
    span = table.shape[1] * bs if sliding_window is None else min(table.shape[1] * bs, int(sliding_window) + tile_n)
    splits = FORCE_SPLITS or kv_splits(R, hkv, 1, span, torch.cuda.get_device_properties(q.device).multi_processor_count
                                       if q.is_cuda else DEFAULT_NUM_SMS)
    tiles_per_split = -(-(-(-span // tile_n) + 1) // splits)  # (+1: a window need not start on a tile)
    dst = out if splits == 1 else torch.empty(R, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = out if splits == 1 else torch.empty(R, hq, splits, dtype=torch.float32, device=q.device)
    with device_guard(q):
        _quantized_decode_kernel[(R, hkv, splits)](
            dst, q, fresh, pool, pool.view(torch.float32), fp8_values_on(pool.device) if fp8 else out,
            slot_mapping, table, seq_lens, out if sink is None else sink, lse, float(scale), float(soft_cap or 0.0),
            int(sliding_window or 0), tiles_per_split, q.stride(0), q.stride(1), dst.stride(0), dst.stride(1),
            dst.stride(2) if splits > 1 else 0, lse.stride(0) if splits > 1 else 0,
            lse.stride(1) if splits > 1 else 0, fresh.stride(0), table.stride(0), HKV=hkv, NBYTES=layout.nbytes,
            CODE_BYTES=layout.code_bytes, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
            D_PAD=d_pad, BLOCK_SIZE=bs, TILE_N=tile_n, FP8=fp8, USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=soft_cap is not None, USE_SINKS=sinks is not None, SPLIT=splits > 1,
            WHILE_LOOP=interpreted(), num_warps=num_warps)
    if splits > 1:
        merge_splits(out, dst, lse)
    return out
