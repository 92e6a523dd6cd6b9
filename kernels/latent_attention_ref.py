"""Torch reference for multi-head latent attention (MLA) over paged latent KV.

A latent page `kv_cache [num_blocks, 1, block_size, 1, D]` holds per token ONE vector of
D = kv_lora_rank + rope_dim: the normalised compressed KV `c` and the key part `k_rot` that every
head shares. Attention expands the request's latents through `kv_b_proj` into per-head keys
`[k_nope(c), k_rot]` and values `v(c)` and attends causally, in fp32.
"""
from __future__ import annotations

import torch


def write_latent_ref(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, D] into kv_cache [N, 1, bs, 1, D] at flat slots `slot_mapping [T]` (-1 skipped)."""
    n, parts, bs, heads, dim = kv_cache.shape
    if parts != 1 or heads != 1 or latent.shape[-1] != dim:
        raise ValueError(f"latent {tuple(latent.shape)} does not fit latent pages {tuple(kv_cache.shape)}; "
                         f"expected pages [blocks, 1, block_size, 1, {latent.shape[-1]}]")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() and int(slots.max()) >= n * bs:
        raise ValueError(f"slot {int(slots.max())} is outside the {n * bs} slots of the latent pages")
    kv_cache.view(n * bs, dim)[slots] = latent[keep].to(kv_cache.dtype)


def latent_paged_attention_ref(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table,
                               scale, nope_dim, v_dim):
    """q [T, H, nope_dim + rope_dim] (the rope part already rotated, if the model rotates);
    kv_cache [N, 1, bs, 1, kv_lora_rank + rope_dim]; kv_b_weight [H * (nope_dim + v_dim),
    kv_lora_rank] (kv_b_proj's weight); query_start_loc [R+1]; seq_lens [R] (tokens of each
    request after this step, the last q rows being its newest); block_table [R, max_blocks].
    Returns o [T, H, v_dim] in q.dtype.
    """
    T, H, qk_dim = q.shape
    bs, dim = kv_cache.shape[2], kv_cache.shape[-1]
    rope_dim = qk_dim - nope_dim
    rank = dim - rope_dim
    if kv_b_weight.shape != (H * (nope_dim + v_dim), rank):
        raise ValueError(f"kv_b_weight {tuple(kv_b_weight.shape)} does not fit {H} heads of "
                         f"{nope_dim}+{v_dim} dims from a latent of {rank}")
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    out = torch.empty(T, H, v_dim, dtype=torch.float32, device=q.device)
    w = kv_b_weight.float()
    for r, L in enumerate(lens):
        a, b = qsl[r], qsl[r + 1]
        if b == a:
            continue
        if not b - a <= L <= block_table.shape[1] * bs:
            raise ValueError(f"request {r}: seq_len {L} must cover its {b - a} new tokens and fit "
                             f"its block table of {block_table.shape[1]} blocks of {bs}")
        blocks = block_table[r, :-(-L // bs)].long()
        lat = kv_cache[blocks, 0, :, 0].reshape(-1, dim)[:L].float()
        kv = (lat[:, :rank] @ w.t()).view(L, H, nope_dim + v_dim)
        k = torch.cat([kv[..., :nope_dim], lat[:, None, rank:].expand(L, H, rope_dim)], dim=-1)
        v = kv[..., nope_dim:]
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        pos = torch.arange(L - (b - a), L, device=q.device)
        scores = scores.masked_fill(torch.arange(L, device=q.device)[None, :] > pos[:, None],
                                    float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)
