"""Latent attention (MLA) for a decode step, one query per request, with no host sync.

The spec is `latent_attention_ref.latent_paged_attention_ref`, which loops over requests on the
host. Here every request runs at once, the shapes fixed by the block table's width alone, so a
CUDA graph can hold the step: queries are absorbed into the latent space (q_nope @ W_k scores
against the latents `c` directly, the context `sum p c` is expanded through W_v once, in fp32 as
the reference), keys past a request's seq_len weigh 0, and the table is read in chunks of
`blocks_per_chunk` blocks merged with an online softmax, so the gathered latents stay
[R, blocks_per_chunk * block_size, D] however wide the table (a graph's table spans max_model_len).
"""
from __future__ import annotations

import torch


def latent_decode_attention(q, kv_cache, kv_b_weight, seq_lens, block_table, scale, nope_dim, v_dim,
                            blocks_per_chunk: int = 64):
    """q [R, H, nope_dim + rope_dim] (request r's newest token; rope part already rotated);
    kv_cache [N, 1, bs, 1, kv_lora_rank + rope_dim]; kv_b_weight [H * (nope_dim + v_dim),
    kv_lora_rank]; seq_lens [R] (>= 1: keys of request r after this step); block_table [R, W]
    (entries past a request's blocks may hold anything, -1 included). Returns o [R, H, v_dim] in
    q.dtype."""
    R, H, qk_dim = q.shape
    n, _, bs, _, dim = kv_cache.shape
    rope_dim = qk_dim - nope_dim
    rank = dim - rope_dim
    if kv_b_weight.shape != (H * (nope_dim + v_dim), rank):
        raise ValueError(f"kv_b_weight {tuple(kv_b_weight.shape)} does not fit {H} heads of "
                         f"{nope_dim}+{v_dim} dims from a latent of {rank}")
    if seq_lens.shape != (R,) or block_table.dim() != 2 or block_table.shape[0] != R:
        raise ValueError(f"a decode step of {R} queries needs seq_lens [{R}] and block_table [{R}, W]; "
                         f"got {tuple(seq_lens.shape)} and {tuple(block_table.shape)}")
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk={blocks_per_chunk} must be >= 1")
    w = kv_b_weight.float().view(H, nope_dim + v_dim, rank)
    qf = q.float()
    q_lat = torch.einsum("rhn,hnc->rhc", qf[..., :nope_dim], w[:, :nope_dim])  # [R, H, rank]
    q_rot = qf[..., nope_dim:]
    pages = kv_cache[:, 0, :, 0]  # [N, bs, D]
    lens = seq_lens.long()[:, None, None]
    best = torch.full((R, H), float("-inf"), device=q.device)
    total = torch.zeros(R, H, device=q.device)
    ctx = torch.zeros(R, H, rank, device=q.device)
    for first in range(0, block_table.shape[1], blocks_per_chunk):
        blocks = block_table[:, first:first + blocks_per_chunk].long().clamp(0, n - 1)
        lat = pages[blocks].reshape(R, -1, dim).float()  # [R, L, D]
        key_pos = torch.arange(first * bs, first * bs + lat.shape[1], device=q.device)
        scores = (torch.einsum("rhc,rlc->rhl", q_lat, lat[..., :rank])
                  + torch.einsum("rhp,rlp->rhl", q_rot, lat[..., rank:])) * scale
        scores = scores.masked_fill(key_pos >= lens, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1))
        shift = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)  # no key yet
        p = torch.exp(scores - shift[..., None])
        keep = torch.exp(best - shift)
        total = total * keep + p.sum(-1)
        ctx = ctx * keep[..., None] + torch.einsum("rhl,rlc->rhc", p, lat[..., :rank])
        best = new_best
    out = torch.einsum("rhc,hvc->rhv", ctx / total[..., None], w[:, nope_dim:])
    return out.to(q.dtype)
