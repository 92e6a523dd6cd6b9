"""GLM-5-Next's DSA layer: rotary-free multi-head latent attention whose queries each see only the
tokens a k-pool indexer selects (transformers' Glm5NextTextAttention / Glm5NextTextIndexer).

Memory: the latent pages of LatentAttention (one kv_a-normed latent of kv_lora_rank per token)
under the layer's key i, and, on layers that run their own indexer ("full" in `indexer_types`),
the indexer's pages under key `num_hidden_layers + i`: an ordinary paged KV entry of one head of
`index_head_dim` whose key part holds the indexer key (LayerNorm(wk x)) and whose value part the
k-pool gate scores (compress_gate x). Both are per-token functions of the prefix, so they are
shared, swapped and migrated as KV is; the pooled keys and the top-k are recomputed from them every
step (kernels/sparse_index_ref.py). A "shared" layer reuses the previous layer's selection.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import AttentionSpec

from .forward_batch import ForwardBatch
from .latent_attention import LatentAttention


def max_query_len(batch: ForwardBatch) -> int | None:
    """The step's longest query (a host fact; None when the batch does not say)."""
    return max(batch.query_lens_cpu) if batch.query_lens_cpu else None


class DsaIndexer(nn.Module):
    """`self_attn.indexer`: x [T, hidden], q_resid [T, q_lora_rank] -> selected [T, max seq_len]."""

    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.kpool, self.topk = config.index_kpool, config.index_topk
        self.select_tail = bool(config.index_kpool_always_select_tail)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, config.hidden_size))

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        """Per token one head of index_head_dim twice: the indexer key and the k-pool gate scores."""
        return AttentionSpec(1, self.head_dim, dtype)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch,
                index_cache: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        key = self.k_norm(self.wk(x))
        gate = torch.nn.functional.linear(x, self.index_kpool_compress_gate)
        ops.write_kv(key.view(T, 1, -1), gate.view(T, 1, -1), index_cache, batch.slot_mapping)
        q = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5
        return ops.pooled_index_select(q, weights, index_cache, self.index_kpool_compress_ape,
                                       batch.query_start_loc, batch.seq_lens, batch.block_table, self.kpool,
                                       self.topk, self.head_dim ** -0.5, self.select_tail, max_query_len(batch))


class DsaAttention(LatentAttention):
    """hidden [T, hidden] -> ([T, hidden], the selection [T, max seq_len] bool). `indexer` is None
    on "shared" layers, which take the previous layer's selection."""

    def __init__(self, config, shared: bool):
        super().__init__(config.hidden_size, config.num_attention_heads, config.kv_lora_rank, config.q_lora_rank,
                         config.qk_nope_head_dim, 0, config.v_head_dim, bias=config.attention_bias)
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = config.rms_norm_eps
        self.indexer = None if shared else DsaIndexer(config)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                index_cache: torch.Tensor | None, selected: torch.Tensor | None):
        T = hidden.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(T, self.num_heads, self.qk_dim)
        ops.write_latent(self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden)), kv_cache, batch.slot_mapping)
        if self.indexer is not None:
            selected = self.indexer(hidden, q_resid, batch, index_cache)
        out = ops.latent_sparse_attention(q, kv_cache, self.kv_b_proj.weight, batch.query_start_loc,
                                          batch.seq_lens, batch.block_table, self.scale, self.nope_dim,
                                          self.v_dim, selected, max_query_len(batch))
        return self.o_proj(out.reshape(T, self.num_heads * self.v_dim)), selected
