"""Torch reference for Qwen4-Exp's QSA: a block-mean indexer over its own key pages, then attention
over the paged KV restricted to the selected tokens (torch on every device, a loop over requests).

- `block_mean_index_select`: the indexer keeps one raw key per token in latent pages
  `index_cache [N, 1, bs, 1, D]`. A query at position t splits its visible tokens [0, t] into
  complete blocks of `ratio` tokens (from the sequence's first token) and a tail; a block's key is
  `key_fn(mean of its raw keys, the block's first position)` (the model's norm and rotary), its
  score sum_h relu(q_h . key) / sqrt(D); the query sees the tokens of its `budget // ratio` best
  blocks and its tail. Exactly transformers' Qwen4ExpTextQSAIndexer for an unpadded sequence.
- `paged_sparse_attention`: softmax attention (GQA) over paged KV where query t sees only the keys
  `selected[t]` marks.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .sparse_index_ref import request_pages, request_rows


def decode_block_mean_index_select(q, index_cache, seq_lens, block_table, ratio: int, budget: int,
                                   key_fn: Callable) -> torch.Tensor:
    """block_mean_index_select for one query per request (q [R, Hi, D]), every request at once over
    the block table's width, without a host sync (decode steps, CUDA graphs). Same selection."""
    raw = request_pages(index_cache, block_table)[:, 0, :, 0]  # [R, W, D]
    R, W, D = raw.shape
    pos = seq_lens.long() - 1
    cols = torch.arange(W, device=q.device)
    complete = (pos + 1) // ratio
    num_blocks = W // ratio
    selected = torch.zeros(R, W, dtype=torch.bool, device=q.device)
    if num_blocks:
        live = (cols[: num_blocks * ratio][None] <= pos[:, None])[..., None]  # garbage past the sequence -> 0
        raw = torch.where(live, raw[:, : num_blocks * ratio], torch.zeros((), dtype=raw.dtype, device=raw.device))
        pooled = raw.view(R, num_blocks, ratio, D).float().mean(dim=2).to(raw.dtype)
        starts = (torch.arange(num_blocks, device=q.device) * ratio).repeat(R)
        keys = key_fn(pooled.view(R * num_blocks, D), starts).view(R, num_blocks, D)
        scores = torch.matmul(q.float(), keys.float().transpose(1, 2)).relu().sum(dim=1) / math.sqrt(D)  # [R, P]
        valid = torch.arange(num_blocks, device=q.device)[None, :] < complete[:, None]
        scores = scores.masked_fill(~valid, float("-inf"))
        chosen = scores.topk(min(budget // ratio, num_blocks), dim=-1).indices
        picked = torch.zeros(R, num_blocks + 1, dtype=torch.bool, device=q.device)
        picked.scatter_(1, chosen, valid.gather(1, chosen))
        selected = picked[:, torch.div(cols, ratio, rounding_mode="floor").clamp(max=num_blocks)]
    return selected | ((cols[None, :] >= (complete * ratio)[:, None]) & (cols[None, :] <= pos[:, None]))


def block_mean_index_select(q, index_cache, query_start_loc, seq_lens, block_table, ratio: int, budget: int,
                            key_fn: Callable, max_query_len=None) -> torch.Tensor:
    """q [T, Hi, D] (normed, rotated); index_cache [N, 1, bs, 1, D]; key_fn(pooled [P, D],
    starts [P] long) -> [P, D]. Returns selected [T, W x bs] bool (W: the block table's width).
    max_query_len 1 (a host fact: one query per request) runs the sync-free decode form."""
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
        return decode_block_mean_index_select(q, index_cache, seq_lens, block_table, ratio, budget, key_fn)
    T, _, D = q.shape
    bs = index_cache.shape[2]
    selected = torch.zeros(T, block_table.shape[1] * bs, dtype=torch.bool, device=q.device)
    for _, a, b, L, blocks in request_rows(query_start_loc, seq_lens, block_table, bs):
        n = b - a
        pos = torch.arange(L - n, L, device=q.device)
        cols = torch.arange(L, device=q.device)
        complete = (pos + 1) // ratio  # per query: its visible complete blocks
        num_blocks = L // ratio
        if num_blocks:
            raw = index_cache[blocks, 0, :, 0].reshape(-1, D)[:num_blocks * ratio]
            pooled = raw.view(num_blocks, ratio, D).float().mean(dim=1).to(raw.dtype)
            keys = key_fn(pooled, torch.arange(num_blocks, device=q.device) * ratio)
            scores = torch.matmul(q[a:b].float(), keys.float().t()).relu().sum(dim=1) / math.sqrt(D)  # [n, P]
            valid = torch.arange(num_blocks, device=q.device)[None, :] < complete[:, None]
            scores = scores.masked_fill(~valid, float("-inf"))
            chosen = scores.topk(min(budget // ratio, num_blocks), dim=-1).indices
            keep = valid.gather(1, chosen)  # fewer visible blocks than the budget: all of them
            picked = torch.zeros(n, num_blocks + 1, dtype=torch.bool, device=q.device)
            picked.scatter_(1, chosen, keep)
            block_of = torch.div(cols, ratio, rounding_mode="floor").clamp(max=num_blocks)
            selected[a:b, :L] = picked[:, block_of]
        tail = (cols[None, :] >= (complete * ratio)[:, None]) & (cols[None, :] <= pos[:, None])
        selected[a:b, :L] |= tail
    return selected


def paged_sparse_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale: float,
                           selected: torch.Tensor, max_query_len=None) -> torch.Tensor:
    """q [T, Hq, D]; kv_cache [N, 2, bs, Hkv, D]; selected [T, >= max seq_len] bool -> o [T, Hq, D]
    in q.dtype (scores and softmax in float32). max_query_len 1 (one query per request, a host
    fact) attends for every request at once, without a host sync."""
    T, Hq, D = q.shape
    bs, Hkv = kv_cache.shape[2], kv_cache.shape[3]
    if max_query_len == 1 and T == seq_lens.shape[0]:
        pages = request_pages(kv_cache, block_table).float()  # [R, 2, W, Hkv, D]
        seen = selected[:, : pages.shape[2]]
        pages = torch.where(seen[:, None, :, None, None], pages, 0)  # garbage past a sequence may hold anything
        k, v = (x.repeat_interleave(Hq // Hkv, dim=2) for x in pages.unbind(1))  # [R, W, Hq, D]
        scores = torch.einsum("rhd,rkhd->rhk", q.float(), k) * scale
        scores = scores.masked_fill(~seen[:, None], float("-inf"))
        return torch.einsum("rhk,rkhd->rhd", scores.softmax(-1), v).to(q.dtype)
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    for _, a, b, L, blocks in request_rows(query_start_loc, seq_lens, block_table, bs):
        kv = kv_cache[blocks].transpose(0, 1).reshape(2, -1, Hkv, D)[:, :L].float()
        k, v = (x.repeat_interleave(Hq // Hkv, dim=1) for x in kv)  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        scores = scores.masked_fill(~selected[a:b, :L][None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)
