"""Zamba2's shared transformer block: attention + MLP whose weights serve several hybrid layers.

One block is built once per `num_mem_blocks` and reused at every hybrid layer (use site) of its
cycle. Each use site s has its own LoRA-style adapters inside the block (`*_adapter_list[s]`; the
entries of other blocks' sites are `nn.Identity`, exactly as transformers lays them out, so the
parameter names are the checkpoint's) and its own KV cache, which the caller passes in.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hybridkv.kernels import ops

from .attention import PagedAttention
from .forward_batch import ForwardBatch
from .norms import RMSNorm
from .rotary import apply_rotary
from .row_parallel import RowParallel


def _adapter_list(num_sites: int, num_blocks: int, block_id: int, d_in: int, rank: int,
                  d_out: int) -> nn.ModuleList:
    """Site s gets down(d_in -> rank) then up(rank -> d_out) when s runs this block, else Identity."""
    return nn.ModuleList(
        nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))
        if s % num_blocks == block_id else nn.Identity()
        for s in range(num_sites))


class Zamba2SharedAttention(PagedAttention):
    """Attention over the width-2H input [hidden | embeddings], with per-site q/k/v adapters.

    head_dim = 2H / heads and scale = (head_dim / 2) ** -0.5, as transformers' Zamba2Attention;
    o_proj maps back to H. Rope only when `use_mem_rope` (forward then gets cos, sin).
    """

    def __init__(self, config, num_sites: int, block_id: int):
        width, heads, kv_heads = config.attention_hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = config.attention_head_dim
        super().__init__(width, heads, kv_heads, head_dim, scale=(head_dim / 2) ** -0.5,
                         out_size=config.hidden_size)  # o_proj back to H, not 2H
        self.use_adapters = bool(config.use_shared_attention_adapter)
        if self.use_adapters:
            if kv_heads * head_dim != width:
                raise ValueError(f"use_shared_attention_adapter needs num_key_value_heads == "
                                 f"num_attention_heads ({heads}), got {kv_heads}: the k/v adapters "
                                 f"emit {width} features; set num_key_value_heads={heads}")
            lists = {n: _adapter_list(num_sites, config.num_mem_blocks, block_id, width,
                                      config.adapter_rank, width) for n in "qkv"}
            self.linear_q_adapter_list = lists["q"]
            self.linear_k_adapter_list = lists["k"]
            self.linear_v_adapter_list = lists["v"]

    def forward(self, hidden: torch.Tensor, site: int, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, 2H] normed -> [T, H]; writes K/V of use site `site` into its own `kv_cache`."""
        T = hidden.shape[0]
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.use_adapters:
            q = q + self.linear_q_adapter_list[site](hidden)
            k = k + self.linear_k_adapter_list[site](hidden)
            v = v + self.linear_v_adapter_list[site](hidden)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        ops.write_kv(k, v, kv_cache, batch.slot_mapping)
        out = ops.paged_attention(
            q.contiguous(), kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
            self.scale, causal=True,
            max_query_len=max(batch.query_lens_cpu) if batch.query_lens_cpu else None,
            max_seq_len=max(batch.seq_lens_cpu) if batch.seq_lens_cpu else None)
        return self.rank_sum(self.o_proj(out.reshape(T, self.num_heads * self.head_dim)))


class Zamba2SharedMLP(RowParallel, nn.Module):
    """x [T, H] -> down(act(gate) * up), [gate | up] = gate_up_proj(x) + the site's adapter(x)."""

    def __init__(self, config, num_sites: int, block_id: int):
        super().__init__()
        from transformers.activations import ACT2FN

        h, inter, bias = config.hidden_size, config.intermediate_size, config.add_bias_linear
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.gate_up_proj_adapter_list = _adapter_list(num_sites, config.num_mem_blocks, block_id, h,
                                                       config.adapter_rank, 2 * inter)

    def forward(self, x: torch.Tensor, site: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[site](x)).chunk(2, dim=-1)
        return self.rank_sum(self.down_proj(self.act_fn(gate) * up))


class Zamba2SharedBlock(nn.Module):
    """[hidden | embeddings] -> input_layernorm (2H) -> self_attn -> pre_ff_layernorm -> feed_forward.

    No residual inside (transformers adds none); the hybrid layer projects the output with its
    own `linear` and adds it to the Mamba input.
    """

    def __init__(self, config, num_sites: int, block_id: int):
        super().__init__()
        self.block_id = block_id
        self.self_attn = Zamba2SharedAttention(config, num_sites, block_id)
        self.feed_forward = Zamba2SharedMLP(config, num_sites, block_id)
        self.input_layernorm = RMSNorm(config.attention_hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, site: int, rope,
                batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden, embeds [T, H] -> [T, H] for use site `site` (its adapters, its KV pool)."""
        x = self.input_layernorm(torch.cat([hidden, embeds], dim=-1))
        x = self.self_attn(x, site, rope, batch, kv_cache)
        return self.feed_forward(self.pre_ff_layernorm(x), site)
