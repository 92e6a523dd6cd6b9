"""Qwen4-Exp's indexed attention: Qwen3.5's gated attention (a sigmoid gate per channel from q_proj,
zero-centered q/k norms, partial rotary) whose queries each see only the tokens the QSA indexer
selects (transformers' Qwen4ExpTextAttention / Qwen4ExpTextQSAIndexer).

Memory: the layer's KV pages under key i; the indexer's raw keys (one head of indexer_head_dim per
token, before its norm and rotary) as latent pages (`AttentionSpec(latent=True)`: one vector per
token) under key `num_hidden_layers + i`. The per-block means, their norm and rotary at the block's
first position and the top-k are recomputed from those pages every step, so the pages are shared on a
hit, swapped and migrated as KV is (kernels/qsa_ref.py).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import AttentionSpec

from .forward_batch import ForwardBatch
from .glm5_next_attention import max_query_len
from .norms import RMSNorm


class RopeTable:
    """inv_freq [rot / 2] float32, kept off the module (it is built on `meta` and cast) and moved lazily."""

    def __init__(self, c):
        rope = c.rope_parameters or {}
        rot = int(c.head_dim * rope.get("partial_rotary_factor", 1.0))
        self.inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rot, 2, device="cpu").float() / rot))

    def on(self, device: torch.device) -> torch.Tensor:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq


def rotate(x: torch.Tensor, positions: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """x [N, H, D] rotated on its first 2 x len(inv_freq) channels at positions [N] (rotate-half)."""
    freqs = positions.float()[:, None] * table.on(positions.device)[None]
    cos, sin = (torch.cat([f, f], dim=-1)[:, None].to(x.dtype) for f in (freqs.cos(), freqs.sin()))
    rot = cos.shape[-1]
    r, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    turned = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
    return torch.cat([r * cos + turned * sin, rest], dim=-1)


class QsaIndexer(nn.Module):
    """`self_attn.indexer`: x [T, hidden] -> selected [T, max seq_len] bool."""

    def __init__(self, c, rope: RopeTable):
        super().__init__()
        self.heads, self.head_dim = c.indexer_n_heads, c.indexer_head_dim
        self.ratio, self.budget = c.indexer_compress_ratio, c.indexer_budget
        self.index_qk_proj = nn.Linear(c.hidden_size, (self.heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, eps=c.rms_norm_eps, zero_centered=True)
        self.k_layernorm = RMSNorm(self.head_dim, eps=c.rms_norm_eps, zero_centered=True)
        self.rope = rope

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        """One raw indexer key per token (latent pages: no value part)."""
        return AttentionSpec(1, self.head_dim, dtype, latent=True)

    def block_keys(self, pooled: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """pooled [P, D] block means -> normed keys rotated at each block's first position."""
        return rotate(self.k_layernorm(pooled)[:, None], starts, self.rope)[:, 0]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, index_cache: torch.Tensor) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, key = self.index_qk_proj(x).split([self.heads * D, D], dim=-1)
        ops.write_latent(key, index_cache, batch.slot_mapping)
        q = rotate(self.q_layernorm(q.view(T, self.heads, D)), batch.positions, self.rope)
        return ops.block_mean_index_select(q, index_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                           self.ratio, self.budget, self.block_keys, max_query_len(batch))


class QsaAttention(nn.Module):
    """`self_attn`: hidden [T, hidden] -> [T, hidden] over its KV pages and the indexer's pages."""

    def __init__(self, c):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope = RopeTable(c)
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=c.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, eps=c.rms_norm_eps, zero_centered=True)
        self.indexer = QsaIndexer(c, self.rope)

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                index_cache: torch.Tensor) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        selected = self.indexer(x, batch, index_cache)
        q, gate = self.q_proj(x).view(T, H, 2 * D).chunk(2, dim=-1)
        q = rotate(self.q_norm(q), batch.positions, self.rope)
        k = rotate(self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, D)), batch.positions, self.rope)
        ops.write_kv(k, self.v_proj(x).view(T, self.num_kv_heads, D), kv_cache, batch.slot_mapping)
        out = ops.paged_sparse_attention(q.contiguous(), kv_cache, batch.query_start_loc, batch.seq_lens,
                                         batch.block_table, D ** -0.5, selected, max_query_len(batch))
        return self.o_proj(out.reshape(T, H * D) * torch.sigmoid(gate.reshape(T, H * D)))
