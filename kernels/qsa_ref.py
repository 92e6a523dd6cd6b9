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

from .sparse_index_ref import request_rows


def block_mean_index_select(q, index_cache, query_start_loc, seq_lens, block_table, ratio: int, budget: int,
                            key_fn: Callable) -> torch.Tensor:
    """q [T, Hi, D] (normed, rotated); index_cache [N, 1, bs, 1, D]; key_fn(pooled [P, D],
    starts [P] long) -> [P, D]. Returns selected [T, max seq_len] bool."""
    T, _, D = q.shape
    bs = index_cache.shape[2]
    width = int(seq_lens.max()) if seq_lens.numel() else 0
    selected = torch.zeros(T, width, dtype=torch.bool, device=q.device)
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
                           selected: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D]; kv_cache [N, 2, bs, Hkv, D]; selected [T, >= max seq_len] bool -> o [T, Hq, D]
    in q.dtype (scores and softmax in float32)."""
    T, Hq, D = q.shape
    bs, Hkv = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    for _, a, b, L, blocks in request_rows(query_start_loc, seq_lens, block_table, bs):
        kv = kv_cache[blocks].transpose(0, 1).reshape(2, -1, Hkv, D)[:, :L].float()
        k, v = (x.repeat_interleave(Hq // Hkv, dim=1) for x in kv)  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        scores = scores.masked_fill(~selected[a:b, :L][None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)
