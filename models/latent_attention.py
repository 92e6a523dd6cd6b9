"""Multi-head latent attention (MLA) over paged LATENT KV, as Kimi-Linear runs it (no rotary).

Per token the layer keeps one vector `[kv_a_layernorm(c) | k_rot]` of kv_lora_rank + rope_dim
elements (AttentionSpec(latent=True)), not per-head keys and values; attention expands the
latents through `kv_b_proj` into every head's `[k_nope | k_rot]` and `v`. Names follow
transformers' KimiLinearAttention (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import AttentionSpec

from .forward_batch import ForwardBatch
from .norms import RMSNorm


class LatentAttention(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] with its latent pages `[N, 1, bs, 1, rank + rope]`.

    q_lora_rank: None for a plain q_proj, else the rank of q's low-rank path. The score scale is
    (nope_dim + rope_dim) ** -0.5. `bias` is transformers' attention_bias (q_a, kv_a, o).
    """

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, q_lora_rank: Optional[int],
                 nope_dim: int, rope_dim: int, v_dim: int, bias: bool = False):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        self.qk_dim = nope_dim + rope_dim
        self.head_dim = self.qk_dim
        self.scale = self.qk_dim ** -0.5
        q_out = num_heads * self.qk_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_dim, hidden_size, bias=bias)

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        """One latent of kv_lora_rank + rope_dim per token (not 2 x heads x head_dim)."""
        return AttentionSpec(1, self.kv_lora_rank + self.rope_dim, dtype, latent=True)

    def forward(self, hidden: torch.Tensor, rope, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Writes this step's latents at batch.slot_mapping, then attends over each request's
        seq_lens[r] latents through its block table. `rope` must be None (Kimi-Linear has none)."""
        if rope is not None:
            raise NotImplementedError("rotary latent attention (DeepSeek MLA) is not supported; "
                                      "Kimi-Linear's MLA has no rotary embedding")
        T = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        c, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        ops.write_latent(torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1), kv_cache,
                         batch.slot_mapping)
        out = ops.latent_paged_attention(
            q.view(T, self.num_heads, self.qk_dim), kv_cache, self.kv_b_proj.weight,
            batch.query_start_loc, batch.seq_lens, batch.block_table, self.scale, self.nope_dim,
            self.v_dim,
            max_query_len=max(batch.query_lens_cpu) if batch.query_lens_cpu else None)
        return self.o_proj(out.reshape(T, self.num_heads * self.v_dim))
