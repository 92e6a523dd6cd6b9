"""One Triton kernel for paged attention over prefill, decode and mixed batches.

Design (as in vLLM's unified Triton attention): a program owns one KV head and a tile of
BLOCK_Q query tokens of one request; the GROUP query heads that share the KV head ride along,
so the tile is [BLOCK_Q tokens x GROUP heads] flattened to BLOCK_M rows and every K/V tile read
from memory serves all of them. Programs walk the request's KV through its block table in
TILE_N-key tiles (each key looks up its own block, so TILE_N need not equal the block size),
skipping tiles wholly outside the causal / sliding window, with an online softmax in float32.

Grid: (num_tokens // BLOCK_Q + num_reqs, kv_heads, splits). Request r's tiles start at program
`query_start_loc[r] // BLOCK_Q + r`, an upper bound that needs no host sync; a program finds its
request by binary search over query_start_loc and exits when its tile is past the request's end.
With splits > 1 (flash-decoding, chosen by split_kv.kv_splits) program z walks only its share of
the key tiles and writes a normalised partial result and its log-sum-exp; split_kv.merge_splits
combines them.

The key loop is a counted `for` when compiled (software-pipelined) and a `while` under
TRITON_INTERPRET: Triton 3.6's interpreter cannot take a tensor, nor even a scalar kernel argument,
as a range() bound ("only 0-dimensional arrays can be converted"); a while loop runs on both.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .attention_ref import check_attention_inputs
from .split_kv import DEFAULT_NUM_SMS, MAX_SPLITS, kv_splits, merge_splits
from .triton_math import fold_sink, interpreted, tanh

@triton.jit
def _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= pid (binary search)."""
    lo = pid * 0  # tensors from the start: num_reqs == 1 arrives as a constexpr
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, lse_ptr, q_ptr, kv_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr, sinks_ptr,
    scale, soft_cap, sliding_window, num_reqs, tiles_per_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    stride_kv_blk, stride_kv_kv, stride_kv_off, stride_kv_h, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_IEEE: tl.constexpr, SPLIT: tl.constexpr, WHILE_LOOP: tl.constexpr,
    USE_SINKS: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + r)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q_local = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    # rows past BLOCK_Q * GROUP exist only when GROUP does not divide BLOCK_M
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = context + q_local
    tok = (q_start + q_local).to(tl.int64)
    q_off = tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # KV range any row of this tile can see; tiles outside it are never loaded
    first_pos = context + q_block * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q - 1, seq_len - 1)
    kv_end = seq_len
    if CAUSAL:
        kv_end = last_pos + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(first_pos - sliding_window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_table_ptr + r.to(tl.int64) * stride_bt
    split = tl.program_id(2)
    tile_lo = kv_start // TILE_N + split * tiles_per_split
    tile_hi = tl.minimum(tl.cdiv(kv_end, TILE_N), tile_lo + tiles_per_split)
    if WHILE_LOOP:  # the interpreter (see the module docstring)
        tile = tile_lo
        while tile < tile_hi:
            m_i, l_i, acc = _attend_tile(
                tile, m_i, l_i, acc, q, q_pos, row_ok, d_ok, offs_d, kv_ptr, bt_row, kv_head,
                kv_start, kv_end, scale, soft_cap, sliding_window, stride_kv_kv, stride_kv_blk,
                stride_kv_off, stride_kv_h, BLOCK_SIZE, TILE_N, CAUSAL, USE_WINDOW, USE_SOFTCAP,
                DOT_IEEE)
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            m_i, l_i, acc = _attend_tile(
                tile, m_i, l_i, acc, q, q_pos, row_ok, d_ok, offs_d, kv_ptr, bt_row, kv_head,
                kv_start, kv_end, scale, soft_cap, sliding_window, stride_kv_kv, stride_kv_blk,
                stride_kv_off, stride_kv_h, BLOCK_SIZE, TILE_N, CAUSAL, USE_WINDOW, USE_SOFTCAP,
                DOT_IEEE)
    if USE_SINKS:  # the head's sink logit joins the denominator once (split 0), with no value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        sink = tl.where(split == 0, sink, float("-inf"))
        m_i, l_i, acc = fold_sink(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:  # partial result of this split; lse in log2 units, -inf where no key was visible
        tl.store(out_ptr + o_off + split * stride_os, out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _attend_tile(tile, m_i, l_i, acc, q, q_pos, row_ok, d_ok, offs_d, kv_ptr, bt_row, kv_head,
                 kv_start, kv_end, scale, soft_cap, sliding_window, stride_kv_kv, stride_kv_blk,
                 stride_kv_off, stride_kv_h, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 DOT_IEEE: tl.constexpr):
    """One TILE_N-key tile of the online softmax: returns the updated (m_i, l_i, acc)."""
    key = tile * TILE_N + tl.arange(0, TILE_N)
    # keys before kv_start are never loaded: their blocks may have been let go (any table entry)
    key_ok = (key >= kv_start) & (key < kv_end)
    blk = tl.load(bt_row + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    base = blk * stride_kv_blk + (key % BLOCK_SIZE) * stride_kv_off + kv_head * stride_kv_h
    k = tl.load(kv_ptr + base[None, :] + offs_d[:, None],
                mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [D_PAD, TILE_N]
    if DOT_IEEE:  # fp32 inputs: full precision, not TF32
        s = tl.dot(q, k, input_precision="ieee") * scale
    else:
        s = tl.dot(q, k) * scale
    if USE_SOFTCAP:
        s = soft_cap * tanh(s / soft_cap)
    s = s * 1.4426950408889634  # log2(e): the softmax runs on exp2
    visible = key_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        visible = visible & (key[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - key[None, :] < sliding_window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet keeps m = -inf; subtract 0 instead to avoid inf - inf
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(kv_ptr + stride_kv_kv + base[:, None] + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, D_PAD]
    if DOT_IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


def _config(group, head_dim, query_len_hint):
    """(BLOCK_M, TILE_N, num_warps): small row tiles for decode, larger for prefill."""
    block_m = max(16, triton.next_power_of_2(group))
    if query_len_hint * group >= 64:
        block_m = max(64, block_m)
    d_pad = triton.next_power_of_2(head_dim)
    tile_n = 64 if d_pad <= 128 else 32
    num_warps = 8 if block_m * d_pad >= 64 * 256 else 4
    return block_m, tile_n, num_warps


def _num_sms(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(t.device).multi_processor_count


def paged_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=True,
                           sliding_window=None, soft_cap=None, max_query_len=None,
                           max_seq_len=None, num_kv_splits=None, sinks=None):
    """Triton paged attention; same inputs, outputs and semantics as `paged_attention_ref`.

    q [T, Hq, D]; kv_cache [num_blocks, 2, bs, Hkv, D] (bs a multiple of 16, last dim
    contiguous); query_start_loc [R+1], seq_lens [R], block_table [R, max_blocks] (int32).
    Returns out [T, Hq, D] in q's dtype; rows past query_start_loc[-1] are left unwritten.
    max_query_len picks the tile shape; max_query_len and max_seq_len (host ints, no device sync)
    pick the split-KV count by split_kv.kv_splits. num_kv_splits forces a count (1..MAX_SPLITS;
    without max_seq_len it is read from seq_lens, a sync on the GPU). sinks [Hq]: per-head sink
    logits in the softmax denominator (GPT-OSS), or None.
    """
    check_attention_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, sliding_window,
                           soft_cap, sinks)
    t, hq, d = q.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    if bs % 16 != 0:
        raise ValueError(f"block_size {bs} must be a multiple of 16 for the Triton kernel")
    if not 16 <= d <= 256:
        raise ValueError(f"head_dim {d} unsupported by the Triton kernel; use 16..256")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's head_dim axis must be contiguous (stride 1)")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}")
    if num_kv_splits is not None and not (isinstance(num_kv_splits, int)
                                          and 1 <= num_kv_splits <= MAX_SPLITS):
        raise ValueError(f"num_kv_splits {num_kv_splits!r} must be an int in 1..{MAX_SPLITS}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32)
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    num_reqs = seq_lens.shape[0]
    if t == 0 or num_reqs == 0:
        return out
    group = hq // hkv
    hint = max_query_len if max_query_len is not None else -(-t // num_reqs)
    block_m, tile_n, num_warps = _config(group, d, hint)
    block_q = block_m // group
    # the most keys one program walks: the context, or the window (plus its tile of queries)
    span = max_seq_len
    if span is None and num_kv_splits not in (None, 1):
        span = int(seq_lens.max())
    if span is not None and sliding_window is not None:
        span = min(span, int(sliding_window) + block_q + tile_n)
    splits = num_kv_splits or kv_splits(num_reqs, hkv, max_query_len, span, _num_sms(q))
    if splits > 1 and triton.next_power_of_2(d) >= 256:
        num_warps = 8  # the fp32 partial store and lse lift head dim 256 to 168 registers (spills)
    # 2**30 tiles: one share holds every tile (the bound never binds)
    tiles_per_split = -(-(-(-span // tile_n) + 1) // splits) if splits > 1 else 1 << 30
    if splits > 1:
        dst = torch.empty((t, hq, splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((t, hq, splits), dtype=torch.float32, device=q.device)
    else:
        dst, lse = out, out  # lse unused
    grid = (t // block_q + num_reqs, hkv, splits)
    guard = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with guard:
        _paged_attention_kernel[grid](
            dst, lse, q, kv_cache, query_start_loc, seq_lens, block_table,
            q if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous(),
            float(scale), float(soft_cap or 0.0), int(sliding_window or 0), num_reqs,
            tiles_per_split, q.stride(0), q.stride(1), dst.stride(0), dst.stride(1),
            dst.stride(2) if splits > 1 else 0, lse.stride(0) if splits > 1 else 0,
            lse.stride(1) if splits > 1 else 0,
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            block_table.stride(0),
            GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=d,
            D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=bs, TILE_N=tile_n,
            CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=soft_cap is not None,
            DOT_IEEE=q.dtype == torch.float32, SPLIT=splits > 1, WHILE_LOOP=interpreted(),
            USE_SINKS=sinks is not None,
            num_warps=num_warps, num_stages=2,
        )
    if splits > 1:
        merge_splits(out, dst, lse)
    return out
