"""Fast torch path for paged attention on CPU: same contract as `attention_ref.paged_attention_ref`.

The reference loops over requests and builds masks for each. Here the one-token decodes of a step
run together: their KV is gathered from the pool into one padded `[R, S_max, Hkv, D]` batch and
attended with two batched matmuls under a length mask. Prefill chunks (query_len > 1) run one
request at a time through `F.scaled_dot_product_attention` with the GQA group folded into the
query rows (no KV copy per query head). Soft-capped layers take the batched matmul path for
prefill too (SDPA has no soft cap). Under a sliding window only the blocks from the first query's
window on are gathered. Checked against the reference in tests/kernels/test_attention_cpu.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_ref import check_attention_inputs


def _first_block(seq_len: int, qlen: int, bs: int, window) -> int:
    """The first block any of the request's queries can see: blocks before it are never read
    (the memory manager may have let them go and handed them to other requests)."""
    return 0 if window is None else max(0, seq_len - qlen - window + 1) // bs


def _gather_kv(kv_cache, block_table, rows, first, nblk):
    """K, V [R, nblk * bs, Hkv, D] in fp32: blocks first[r] .. first[r] + nblk - 1 of each row."""
    cols = first.view(-1, 1) + torch.arange(nblk, device=first.device)
    cols = cols.clamp_(max=block_table.shape[1] - 1)  # past a short row's end: masked keys
    # unused entries may hold any id (even -1): clamp into the pool, their keys are masked
    blocks = block_table[rows.view(-1, 1), cols].long().clamp_(0, kv_cache.shape[0] - 1)
    kv = kv_cache[blocks]  # [R, nblk, 2, bs, Hkv, D]
    r, _, _, bs, hkv, d = kv.shape
    kv = kv.transpose(1, 2).reshape(r, 2, nblk * bs, hkv, d).float()
    return kv[:, 0], kv[:, 1]


def _visible(pos, key, seq_len, causal, sliding_window):
    """bool mask [.., L, S]: key j visible to the query at absolute position p."""
    vis = key < seq_len
    if causal:
        vis = vis & (key <= pos)
    if sliding_window is not None:
        vis = vis & (pos - key < sliding_window)
    return vis


def _attend(q, k, v, vis, scale, soft_cap):
    """q [R, Hkv, G, L, D], k/v [R, Hkv, S, D], vis [R, 1, 1, L, S] -> [R, Hkv, G, L, D] fp32."""
    logits = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    if soft_cap is not None:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    logits = logits.masked_fill(~vis, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a row with no key gives zeros
    return probs @ v.unsqueeze(2)


def _batched(q, kv_cache, block_table, reqs, starts, qlens, lens, scale, causal, window, soft_cap):
    """Requests `reqs` (same padded query length Lmax) at once; returns [R, Lmax, Hq, D] fp32."""
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    t, hq, d = q.shape
    g = hq // hkv
    lmax = max(qlens)
    firsts = [_first_block(s, n, bs, window) for s, n in zip(lens, qlens)]
    nblk = max(-(-s // bs) - f for s, f in zip(lens, firsts))
    rows = torch.tensor(reqs, device=q.device)
    first = torch.tensor(firsts, device=q.device)
    k, v = _gather_kv(kv_cache, block_table, rows, first, nblk)  # [R, S, Hkv, D]
    # queries padded to lmax per request; padding rows point at row 0 and are dropped later
    idx = torch.tensor([[s + i if i < n else 0 for i in range(lmax)] for s, n in zip(starts, qlens)],
                       device=q.device)
    qr = q[idx].float().view(len(reqs), lmax, hkv, g, d).permute(0, 2, 3, 1, 4)  # [R, Hkv, G, L, D]
    seq = torch.tensor(lens, device=q.device).view(-1, 1, 1)
    ql = torch.tensor(qlens, device=q.device).view(-1, 1, 1)
    pos = seq - ql + torch.arange(lmax, device=q.device).view(1, -1, 1)  # [R, L, 1]
    key = (first * bs).view(-1, 1, 1) + torch.arange(nblk * bs, device=q.device).view(1, 1, -1)
    vis = _visible(pos, key, seq, causal, window)[:, None, None]
    # keys past seq_len (a block's unwritten tail, padding columns) hold another owner's data: a
    # zero weight times a non-finite value there would still be NaN, so zero them
    v = v.masked_fill((key[:, 0] >= seq[:, 0])[..., None, None], 0.0)
    o = _attend(qr, k.transpose(1, 2), v.transpose(1, 2), vis, scale, soft_cap)
    return o.permute(0, 3, 1, 2, 4).reshape(len(reqs), lmax, hq, d)


def _prefill_sdpa(q, kv_cache, block_table, r, q0, qlen, seq_len, scale, causal, window):
    """One request through SDPA, group folded into rows: returns [qlen, Hq, D] fp32."""
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    hq, d = q.shape[1], q.shape[2]
    g = hq // hkv
    first = _first_block(seq_len, qlen, bs, window)
    k, v = _gather_kv(kv_cache, block_table, torch.tensor([r], device=q.device),
                      torch.tensor([first], device=q.device), -(-seq_len // bs) - first)
    k0 = first * bs  # position of the first key read
    k, v = k[0, :seq_len - k0].transpose(0, 1), v[0, :seq_len - k0].transpose(0, 1)  # [Hkv, S, D]
    qr = q[q0:q0 + qlen].float().view(qlen, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * qlen, d)
    pos = torch.arange(seq_len - qlen, seq_len, device=q.device).view(-1, 1)
    key = torch.arange(k0, seq_len, device=q.device).view(1, -1)
    vis = _visible(pos, key, seq_len, causal, window)  # [L, S]
    mask = None if not causal and window is None else vis.repeat(g, 1)  # rows are (group, query)
    o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale)  # [Hkv, G*L, D]
    return o.view(hkv, g, qlen, d).permute(2, 0, 1, 3).reshape(qlen, hq, d)


def paged_attention_cpu(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=True,
                        sliding_window=None, soft_cap=None, max_query_len=None, max_seq_len=None):
    """Packed queries over paged KV; inputs, outputs and semantics as `paged_attention_ref`.

    q [T, Hq, D]; kv_cache [num_blocks, 2, bs, Hkv, D]; query_start_loc [R+1]; seq_lens [R];
    block_table [R, max_blocks]. Returns out [T, Hq, D] in q's dtype (rows past qsl[-1] zero).
    """
    check_attention_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, sliding_window,
                           soft_cap)
    bs = kv_cache.shape[2]
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    out = torch.zeros_like(q)
    decodes, prefills = [], []
    for r, seq_len in enumerate(lens):
        qlen = qsl[r + 1] - qsl[r]
        if qlen == 0:
            continue
        if qlen > seq_len:
            raise ValueError(f"request {r}: query_len {qlen} > seq_len {seq_len}; seq_len counts "
                             "the cached context plus the new tokens")
        if -(-seq_len // bs) > block_table.shape[1]:
            raise ValueError(f"request {r}: seq_len {seq_len} needs {-(-seq_len // bs)} blocks of "
                             f"{bs}; block_table has {block_table.shape[1]} columns")
        (decodes if qlen == 1 else prefills).append(r)
    if decodes:
        o = _batched(q, kv_cache, block_table, decodes, [qsl[r] for r in decodes], [1] * len(decodes),
                     [lens[r] for r in decodes], scale, causal, sliding_window, soft_cap)
        out[torch.tensor([qsl[r] for r in decodes], device=q.device)] = o[:, 0].to(q.dtype)
    for r in prefills:
        q0, qlen = qsl[r], qsl[r + 1] - qsl[r]
        if soft_cap is None:
            o = _prefill_sdpa(q, kv_cache, block_table, r, q0, qlen, lens[r], scale, causal,
                              sliding_window)
        else:
            o = _batched(q, kv_cache, block_table, [r], [q0], [qlen], [lens[r]], scale, causal,
                         sliding_window, soft_cap)[0]
        out[q0:q0 + qlen] = o.to(q.dtype)
    return out
