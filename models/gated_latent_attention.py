"""Ling 3 (BailingHybrid) latent attention: DeepSeek-style MLA with interleaved rotary on the rope
part and a sigmoid gate per head, over the same paged LATENT KV as Kimi-Linear's MLA.

The rope part of each key is rotated before it is written, so a page holds `[kv_a_layernorm(c) |
rotated k_rot]` per token and attention needs no positions. transformers rotates interleaved pairs
(x0, x1), (x2, x3)... and writes the result de-interleaved (evens | odds); queries and keys get the
same layout, so the scores are transformers'.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops

from .forward_batch import ForwardBatch
from .latent_attention import LatentAttention
from .rotary import apply_rotary


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, R] rotated in interleaved pairs by cos/sin [T, R]; returned as (evens | odds)."""
    return apply_rotary(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)


class GatedLatentAttention(LatentAttention):
    """hidden [T, hidden_size] -> [T, hidden_size]; LatentAttention's names plus `g_proj` [heads,
    hidden] (the per-head output gate)."""

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, q_lora_rank, nope_dim: int,
                 rope_dim: int, v_dim: int, bias: bool = False):
        super().__init__(hidden_size, num_heads, kv_lora_rank, q_lora_rank, nope_dim, rope_dim, v_dim, bias)
        self.g_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def forward(self, hidden: torch.Tensor, rope, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """`rope` = (cos, sin) [T, rope_dim] at batch.positions. Writes this step's latents at
        batch.slot_mapping, then attends over each request's seq_lens[r] latents."""
        cos, sin = rope
        T = hidden.shape[0]
        q = self.q_proj(hidden) if self.q_lora_rank is None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rot = q.view(T, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, rotate_interleaved(q_rot, cos, sin)], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rot = rotate_interleaved(k_rot[:, None, :], cos, sin)[:, 0]
        ops.write_latent(torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1), kv_cache,
                         batch.slot_mapping)
        out = ops.latent_paged_attention(
            q, kv_cache, self.kv_b_proj.weight, batch.query_start_loc, batch.seq_lens,
            batch.block_table, self.scale, self.nope_dim, self.v_dim,
            max_query_len=max(batch.query_lens_cpu) if batch.query_lens_cpu else None)  # [T, heads, v_dim]
        gate = torch.sigmoid(self.g_proj(hidden).float()).to(out.dtype)
        return self.o_proj((out * gate[..., None]).reshape(T, self.num_heads * self.v_dim))
