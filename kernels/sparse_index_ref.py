"""Torch reference for DeepSeek sparse attention with k-pool compression (GLM-5-Next's DSA layers).

Two ops over paged memory, both looping over requests (torch on every device):

- `pooled_index_select`: the indexer. Its own pages `index_cache [N, 2, bs, 1, D]` hold per token
  the indexer key (part 0) and the k-pool gate scores (part 1). Every complete pool of `kpool`
  tokens (positions [j P, (j + 1) P), counted from the sequence's first token) is one candidate
  whose key is the per-channel softmax(gate + ape)-weighted mean of its tokens' keys; a query scores
  it as sum_h w_h * relu(q_h . key * scale), keeps the `topk // kpool` best among the pools that
  end at or before it, and sees their tokens plus its own incomplete pool (the tail).
  Exactly transformers' Glm5NextTextIndexer for an unpadded sequence (the pools a chunk has not
  completed yet only widen transformers' masked candidates; masked ones are never chosen).
- `latent_sparse_attention`: multi-head latent attention (no rotary) over latent pages where each
  query sees only the keys its row of `selected` marks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def request_rows(query_start_loc, seq_lens, block_table, bs: int):
    """(r, first row, last row, seq len, the request's block ids) for every request with queries."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, L in enumerate(lens):
        a, b = qsl[r], qsl[r + 1]
        if b == a:
            continue
        if not b - a <= L <= block_table.shape[1] * bs:
            raise ValueError(f"request {r}: seq_len {L} must cover its {b - a} new tokens and fit "
                             f"its block table of {block_table.shape[1]} blocks of {bs}")
        yield r, a, b, L, block_table[r, :-(-L // bs)].long()


def request_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [N, parts, bs, heads, D] -> every request's pages [R, parts, W x bs, heads, D] over the
    block table's width W (no host sync; entries past a request's blocks are garbage to mask)."""
    n, parts, bs, heads, dim = cache.shape
    pages = cache[block_table.long().clamp(0, n - 1)]  # [R, W, parts, bs, heads, D]
    return pages.transpose(1, 2).reshape(block_table.shape[0], parts, -1, heads, dim)


def decode_pooled_index_select(q, weights, index_cache, ape, seq_lens, block_table, kpool: int, topk: int,
                               scale: float, select_tail: bool = True) -> torch.Tensor:
    """pooled_index_select for one query per request (q [R, Hi, D]), every request at once over the
    block table's width, without a host sync (decode steps, CUDA graphs). Same selection."""
    pages = request_pages(index_cache, block_table)[:, :, :, 0].float()  # [R, 2, W, D]
    R, _, W, D = pages.shape
    pos = seq_lens.long() - 1
    cols = torch.arange(W, device=q.device)
    selected = torch.zeros(R, W, dtype=torch.bool, device=q.device)
    num_pools = W // kpool
    if num_pools:
        live = (cols[: num_pools * kpool][None] <= pos[:, None])[..., None]  # garbage past the sequence -> 0
        keys = torch.where(live, pages[:, 0, : num_pools * kpool], 0).to(index_cache.dtype)
        gates = torch.where(live, pages[:, 1, : num_pools * kpool], 0).to(index_cache.dtype)
        keys, gates = keys.view(R, num_pools, kpool, D), gates.view(R, num_pools, kpool, D)
        probs = torch.softmax(gates.float() + ape.float()[None, None], dim=2).to(keys.dtype)
        pool_keys = (probs * keys).sum(dim=2)  # [R, P, D]
        scores = F.relu(torch.matmul(q.float(), pool_keys.float().transpose(1, 2)) * scale)  # [R, Hi, P]
        index = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)  # [R, P]
        ends = torch.arange(num_pools, device=q.device) * kpool + kpool - 1
        valid = ends[None, :] <= pos[:, None]
        index = index.masked_fill(~valid, torch.finfo(index.dtype).min)
        chosen = index.topk(min(topk // kpool, num_pools), dim=-1).indices
        picked = torch.zeros(R, num_pools + 1, dtype=torch.bool, device=q.device)
        picked.scatter_(1, chosen, valid.gather(1, chosen))
        selected = picked[:, torch.div(cols, kpool, rounding_mode="floor").clamp(max=num_pools)]
    if select_tail:
        tail_start = (pos + 1) - (pos + 1) % kpool
        selected = selected | ((cols[None, :] >= tail_start[:, None]) & (cols[None, :] <= pos[:, None]))
    return selected


def pooled_index_select(q, weights, index_cache, ape, query_start_loc, seq_lens, block_table, kpool: int,
                        topk: int, scale: float, select_tail: bool = True, max_query_len=None) -> torch.Tensor:
    """q [T, Hi, D] indexer queries; weights [T, Hi] float32 per-head weights (already times
    Hi ** -0.5); index_cache [N, 2, bs, 1, D] (key | gate score per token); ape [kpool, D].
    Returns selected [T, W x bs] bool (W: the block table's width): row t marks the keys of its
    request that query t sees. max_query_len 1 (a host fact: one query per request) runs the
    sync-free decode form."""
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
        return decode_pooled_index_select(q, weights, index_cache, ape, seq_lens, block_table, kpool, topk, scale,
                                          select_tail)
    T = q.shape[0]
    bs, D = index_cache.shape[2], index_cache.shape[-1]
    selected = torch.zeros(T, block_table.shape[1] * bs, dtype=torch.bool, device=q.device)
    for _, a, b, L, blocks in request_rows(query_start_loc, seq_lens, block_table, bs):
        n = b - a
        pages = index_cache[blocks, :, :, 0].transpose(0, 1).reshape(2, -1, D)[:, :L]
        pos = torch.arange(L - n, L, device=q.device)
        cols = torch.arange(L, device=q.device)
        num_pools = L // kpool
        if num_pools:
            keys = pages[0, :num_pools * kpool].view(num_pools, kpool, D)
            gates = pages[1, :num_pools * kpool].view(num_pools, kpool, D)
            probs = torch.softmax(gates.float() + ape.float()[None], dim=1).to(keys.dtype)
            pool_keys = (probs * keys).sum(dim=1)  # [P, D]
            scores = F.relu(torch.matmul(q[a:b].float(), pool_keys.float().t()) * scale)  # [n, Hi, P]
            index = torch.matmul(weights[a:b].float().unsqueeze(-2), scores).squeeze(-2)  # [n, P]
            ends = torch.arange(num_pools, device=q.device) * kpool + kpool - 1
            valid = ends[None, :] <= pos[:, None]
            index = index.masked_fill(~valid, torch.finfo(index.dtype).min)
            chosen = index.topk(min(topk // kpool, num_pools), dim=-1).indices
            keep = valid.gather(1, chosen)  # a query with fewer valid pools than k takes them all
            pool_of = torch.div(cols, kpool, rounding_mode="floor")
            picked = torch.zeros(n, num_pools + 1, dtype=torch.bool, device=q.device)
            picked.scatter_(1, chosen, keep)
            selected[a:b, :L] = picked[:, pool_of.clamp(max=num_pools)] & (pool_of < num_pools)[None]
        if select_tail:
            tail_start = (pos + 1) - (pos + 1) % kpool
            selected[a:b, :L] |= (cols[None, :] >= tail_start[:, None]) & (cols[None, :] <= pos[:, None])
    return selected


def latent_sparse_attention(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale,
                            nope_dim: int, v_dim: int, selected: torch.Tensor, max_query_len=None) -> torch.Tensor:
    """q [T, H, nope_dim]; kv_cache [N, 1, bs, 1, kv_lora_rank]; kv_b_weight [H * (nope_dim +
    v_dim), kv_lora_rank]; selected [T, >= max seq_len] bool (pooled_index_select's). Softmax in
    float32 over each query's selected keys -> o [T, H, v_dim] in q.dtype. max_query_len 1 (one
    query per request, a host fact) attends for every request at once, without a host sync."""
    T, H, _ = q.shape
    bs, rank = kv_cache.shape[2], kv_cache.shape[-1]
    if kv_b_weight.shape != (H * (nope_dim + v_dim), rank):
        raise ValueError(f"kv_b_weight {tuple(kv_b_weight.shape)} does not fit {H} heads of "
                         f"{nope_dim}+{v_dim} dims from a latent of {rank}")
    if max_query_len == 1 and T == seq_lens.shape[0]:
        lat = request_pages(kv_cache, block_table)[:, 0, :, 0].float()  # [R, W, rank]
        seen = selected[:, : lat.shape[1]]
        lat = torch.where(seen[..., None], lat, 0)  # garbage pages past a sequence may hold anything
        kv = (lat @ kv_b_weight.float().t()).view(T, -1, H, nope_dim + v_dim)
        scores = torch.einsum("rhd,rkhd->rhk", q.float(), kv[..., :nope_dim]) * scale
        scores = scores.masked_fill(~seen[:, None], float("-inf"))
        return torch.einsum("rhk,rkhd->rhd", scores.softmax(-1), kv[..., nope_dim:]).to(q.dtype)
    out = torch.zeros(T, H, v_dim, dtype=torch.float32, device=q.device)
    w = kv_b_weight.float()
    for _, a, b, L, blocks in request_rows(query_start_loc, seq_lens, block_table, bs):
        lat = kv_cache[blocks, 0, :, 0].reshape(-1, rank)[:L].float()
        kv = (lat @ w.t()).view(L, H, nope_dim + v_dim)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), kv[..., :nope_dim]) * scale
        scores = scores.masked_fill(~selected[a:b, :L][None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., nope_dim:])
    return out.to(q.dtype)
