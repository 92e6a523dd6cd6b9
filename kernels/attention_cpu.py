"""Fast torch path for paged attention on CPU: same contract as `attention_ref.paged_attention_ref`.

The cost follows the tokens held, not (requests x longest context). One-token decodes are sorted
by the number of blocks they read and cut into buckets whose padding at most doubles their work,
so one long request runs in its own bucket instead of making every short one pay for its length.
A bucket gathers its whole blocks with one `index_select` straight into a `[Hkv, R, S, D]` layout
and attends with two batched matmuls, the GQA group folded into the query rows (no copy of K or V
per query head). Prefill chunks (query_len > 1) run one request at a time through
`F.scaled_dot_product_attention` on the same gather; soft-capped layers take the batched matmul
path for prefill too (SDPA has no soft cap). Under a sliding window only the blocks from the first
query's window on are gathered: blocks before it may already belong to another request.
Checked against the reference in tests/kernels/test_attention_cpu.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_ref import check_attention_inputs


def _first_block(seq_len: int, qlen: int, bs: int, window) -> int:
    """The first block any of the request's queries can see: blocks before it are never read
    (the memory manager may have let them go and handed them to other requests)."""
    return 0 if window is None else max(0, seq_len - qlen - window + 1) // bs


def decode_buckets(nblocks: list[int], waste: float = 2.0) -> list[list[int]]:
    """Indices into `nblocks` (blocks each decode reads), cut into buckets run as one batch each.

    Sorted by length; a bucket takes the next (longest so far) request while its padded size
    (count x longest) stays within `waste` times the blocks its requests really read.
    """
    order = sorted(range(len(nblocks)), key=nblocks.__getitem__)
    buckets, cur, held = [], [], 0
    for i in order:
        n = nblocks[i]
        if cur and n * (len(cur) + 1) > waste * (held + n):
            buckets.append(cur)
            cur, held = [], 0
        cur.append(i)
        held += n
    return buckets + [cur] if cur else buckets


def _gather_kv(kv_cache, block_table, rows, first, nblk):
    """K, V [Hkv, R, nblk * bs, D] fp32: blocks first[r] .. first[r] + nblk - 1 of each row,
    gathered with one index_select of whole blocks from the pool viewed as
    [2, Hkv, blocks, bs, D]."""
    cols = first.view(-1, 1) + torch.arange(nblk, device=first.device)
    cols = cols.clamp_(max=block_table.shape[1] - 1)  # past a short row's end: masked keys
    # unused entries may hold any id (even -1): clamp into the pool, their keys are masked
    blocks = block_table[rows.view(-1, 1), cols].long().clamp_(0, kv_cache.shape[0] - 1)
    _, _, bs, hkv, d = kv_cache.shape
    kv = kv_cache.permute(1, 3, 0, 2, 4).index_select(2, blocks.view(-1))  # [2, Hkv, R*nblk, bs, D]
    kv = kv.view(2, hkv, rows.shape[0], nblk * bs, d)
    kv = kv if kv.dtype == torch.float32 else kv.float()
    return kv[0], kv[1]


def _visible(pos, key, seq_len, causal, sliding_window):
    """bool mask [.., L, S]: key j visible to the query at absolute position p."""
    vis = key < seq_len
    if causal:
        vis = vis & (key <= pos)
    if sliding_window is not None:
        vis = vis & (pos - key < sliding_window)
    return vis


def _batched(q, kv_cache, block_table, reqs, starts, qlens, lens, scale, causal, window, soft_cap):
    """Requests `reqs` (queries padded to the longest, Lmax) at once: [R, Lmax, Hq, D] fp32."""
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    _, hq, d = q.shape
    g, r_n, lmax = hq // hkv, len(reqs), max(qlens)
    firsts = [_first_block(s, n, bs, window) for s, n in zip(lens, qlens)]
    nblk = max(-(-s // bs) - f for s, f in zip(lens, firsts))
    dev = q.device
    first = torch.tensor(firsts, device=dev)
    k, v = _gather_kv(kv_cache, block_table, torch.tensor(reqs, device=dev), first, nblk)
    s_n = nblk * bs
    # queries padded to lmax per request; padding rows point at row 0 and are dropped later
    if lmax == 1:
        idx = torch.tensor(starts, device=dev)
    else:
        idx = torch.tensor([[s + i if i < n else 0 for i in range(lmax)]
                            for s, n in zip(starts, qlens)], device=dev).view(-1)
    qr = q.index_select(0, idx).float().mul_(scale).view(r_n, lmax, hkv, g, d)
    qr = qr.permute(2, 0, 3, 1, 4).reshape(hkv * r_n, g * lmax, d)  # rows are (group, query)
    logits = torch.bmm(qr, k.view(hkv * r_n, s_n, d).transpose(1, 2))  # [Hkv*R, G*L, S]
    if soft_cap is not None:
        logits.div_(soft_cap).tanh_().mul_(soft_cap)
    seq = torch.tensor(lens, device=dev).view(-1, 1, 1)
    ql = torch.tensor(qlens, device=dev).view(-1, 1, 1)
    pos = seq - ql + torch.arange(lmax, device=dev).view(1, -1, 1)  # [R, L, 1]
    key = (first * bs).view(-1, 1, 1) + torch.arange(s_n, device=dev).view(1, 1, -1)  # [R, 1, S]
    hidden = ~_visible(pos, key, seq, causal, window)  # [R, L, S]
    if bool(hidden.any()):
        logits.view(hkv, r_n, g, lmax, s_n).masked_fill_(hidden[None, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # every real query sees its own key: no empty row
    # keys past seq_len (a block's unwritten tail, padding columns) hold another owner's data: a
    # zero weight times a non-finite value there would still be NaN, so zero them (only those rows:
    # a broadcast mask over all of V costs more than the attention)
    tail = (key[:, 0] >= seq[:, 0]).view(-1).nonzero().squeeze(1)  # flat (request, key) rows
    if tail.numel():
        v.view(hkv, r_n * s_n, d).index_fill_(1, tail, 0.0)
    o = torch.bmm(probs, v.view(hkv * r_n, s_n, d))  # [Hkv*R, G*L, D]
    return o.view(hkv, r_n, g, lmax, d).permute(1, 3, 0, 2, 4).reshape(r_n, lmax, hq, d)


def _prefill_sdpa(q, kv_cache, block_table, r, q0, qlen, seq_len, scale, causal, window):
    """One request through SDPA, group folded into rows: returns [qlen, Hq, D] fp32."""
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    hq, d = q.shape[1], q.shape[2]
    g = hq // hkv
    first = _first_block(seq_len, qlen, bs, window)
    k, v = _gather_kv(kv_cache, block_table, torch.tensor([r], device=q.device),
                      torch.tensor([first], device=q.device), -(-seq_len // bs) - first)
    k0 = first * bs  # position of the first key read
    k, v = k[:, 0, :seq_len - k0], v[:, 0, :seq_len - k0]  # [Hkv, S, D]
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
    nblocks = [-(-lens[r] // bs) - _first_block(lens[r], 1, bs, sliding_window) for r in decodes]
    for bucket in decode_buckets(nblocks):
        reqs = [decodes[i] for i in bucket]
        rows = [qsl[r] for r in reqs]
        o = _batched(q, kv_cache, block_table, reqs, rows, [1] * len(reqs), [lens[r] for r in reqs],
                     scale, causal, sliding_window, soft_cap)
        out[torch.tensor(rows, device=q.device)] = o[:, 0].to(q.dtype)
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
