"""Torch reference for paged attention and the KV write: the specification the Triton kernels meet.

Layout of one attention layer's cache: `kv_cache [num_blocks, 2, block_size, kv_heads, head_dim]`
(index 0 = K, 1 = V). Token `pos` of request `r` lives in block `block_table[r, pos // block_size]`
at offset `pos % block_size`; its flat slot is `block * block_size + offset`.
"""
from __future__ import annotations

import torch


def check_attention_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, sliding_window,
                           soft_cap, sinks=None):
    """Shape checks shared by the reference and the Triton kernel (no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, heads, head_dim]; got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache must be [num_blocks, 2, block_size, kv_heads, head_dim]; "
                         f"got shape {tuple(kv_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv, dk = kv_cache.shape[3], kv_cache.shape[4]
    if dk != d:
        raise ValueError(f"q head_dim {d} != kv_cache head_dim {dk}")
    if hq % hkv != 0:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv} (GQA)")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries; expected "
                         f"num_reqs + 1 = {num_reqs + 1}")
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"block_table must be [num_reqs={num_reqs}, max_blocks]; got "
                         f"{tuple(block_table.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}; must be >= 1 or None")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap={soft_cap}; must be > 0 or None")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; expected one logit per query head: ({hq},)")


def paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=True,
                        sliding_window=None, soft_cap=None, max_query_len=None, max_seq_len=None,
                        sinks=None):
    """Attention of packed queries over paged KV.

    q [T, Hq, D]; kv_cache [num_blocks, 2, bs, Hkv, D]; query_start_loc [R+1] int32 (request r
    owns rows qsl[r]:qsl[r+1]); seq_lens [R] int32 (tokens in the cache for r, new ones included);
    block_table [R, max_blocks] int32. Returns out [T, Hq, D] in q's dtype (padding rows past
    query_start_loc[-1] are zero here and left unwritten by the Triton kernel).

    Request r's queries are the LAST `query_len_r` of its `seq_len_r` positions: query i sits at
    absolute position `p = seq_len_r - query_len_r + i`. With `causal` it sees keys j <= p
    (otherwise all j < seq_len_r). `sliding_window=w` keeps keys with `p - j < w` (the query and
    the w-1 before it; transformers' sliding_window_overlay, as in Mistral/Qwen2); block-table
    entries of blocks wholly before every query's window are never read (any value, even -1).
    `soft_cap=c`
    maps logits to `c * tanh(logits / c)` after `scale` (Gemma2). GQA: query head h reads KV head
    h // (Hq // Hkv). Accumulation in float32. max_query_len / max_seq_len are hints, unused here.
    `sinks [Hq]`: a learned logit per query head that joins every row's softmax denominator and
    has no value (GPT-OSS): weights are exp(l_j) / (exp(s_h) + sum_j exp(l_j)).
    """
    check_attention_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, sliding_window,
                           soft_cap, sinks)
    t, hq, d = q.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = hq // hkv
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.zeros_like(q)  # rows past query_start_loc[-1] (padding) stay zero
    for r, seq_len in enumerate(lens):
        q0, q1 = qsl[r], qsl[r + 1]
        qlen = q1 - q0
        if qlen == 0:
            continue
        if qlen > seq_len:
            raise ValueError(f"request {r}: query_len {qlen} > seq_len {seq_len}; seq_len counts "
                             "the cached context plus the new tokens")
        nblk = -(-seq_len // bs)
        if nblk > block_table.shape[1]:
            raise ValueError(f"request {r}: seq_len {seq_len} needs {nblk} blocks of {bs}; "
                             f"block_table has {block_table.shape[1]} columns")
        # blocks wholly before the first query's window are never read: they may be let go
        first = 0 if sliding_window is None else max(0, seq_len - qlen - sliding_window + 1) // bs
        k0, n = first * bs, nblk - first  # k0: position of the first key read
        kv = kv_cache[block_table[r, first:nblk].long()].float()  # [n, 2, bs, Hkv, D]
        k = kv[:, 0].reshape(n * bs, hkv, d)[:seq_len - k0].permute(1, 2, 0)  # [Hkv, D, S - k0]
        v = kv[:, 1].reshape(n * bs, hkv, d)[:seq_len - k0].transpose(0, 1)  # [Hkv, S - k0, D]
        qr = q[q0:q1].float().reshape(qlen, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, L, D]
        logits = (qr @ k.unsqueeze(1)) * scale  # [Hkv, G, L, S]
        if soft_cap is not None:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        pos = torch.arange(seq_len - qlen, seq_len, device=q.device).unsqueeze(1)  # [L, 1]
        key = torch.arange(k0, seq_len, device=q.device).unsqueeze(0)  # [1, S - k0]
        visible = torch.ones(qlen, seq_len - k0, dtype=torch.bool, device=q.device)
        if causal:
            visible &= key <= pos
        if sliding_window is not None:
            visible &= pos - key < sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more column per row, the head's sink, dropped after softmax
            sink = sinks.float().view(hkv, group, 1, 1).expand(hkv, group, qlen, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no key gives zeros
        o = probs @ v.unsqueeze(1)  # [Hkv, G, L, D]
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(qlen, hq, d).to(q.dtype)
    return out


def write_kv_ref(k, v, kv_cache, slot_mapping):
    """Write k, v [T, Hkv, D] into kv_cache [num_blocks, 2, bs, Hkv, D] in place.

    slot_mapping [T] (int64): token t goes to block slot // bs, offset slot % bs; slot -1 is
    skipped (padding). Returns kv_cache.
    """
    check_write_kv_inputs(k, v, kv_cache, slot_mapping)
    bs = kv_cache.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // bs, slots % bs
    kv_cache[blk, 0, off] = k[keep].to(kv_cache.dtype)
    kv_cache[blk, 1, off] = v[keep].to(kv_cache.dtype)
    return kv_cache


def check_write_kv_inputs(k, v, kv_cache, slot_mapping):
    """Shape checks shared by write_kv_ref and the Triton kernel (no device sync)."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache must be [num_blocks, 2, block_size, kv_heads, head_dim]; "
                         f"got shape {tuple(kv_cache.shape)}")
    want = (slot_mapping.shape[0], kv_cache.shape[3], kv_cache.shape[4])
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [T, kv_heads, "
                             f"head_dim] = {want} to match slot_mapping and kv_cache")
