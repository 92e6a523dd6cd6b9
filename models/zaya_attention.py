"""Zaya's attention: compressed convolutional attention (CCA) projections, then paged attention.

As transformers' ZayaCCAProjection / ZayaQKNorm / ZayaAttention, per token:
- q and k are projected, and their concatenation runs through a causal depthwise conv (kernel
  `cca_time0`) then a grouped conv (kernel `cca_time1`, one group of head_dim channels per q and
  k head); q and k add residual paths (q averaged with its KV head's k, and k the mean of its
  group's averaged q's);
- values: half of each value vector from this token (`v_proj_current`), half from the PREVIOUS
  token (`v_proj_delayed`; at position 0, v_proj_delayed of zeros, i.e. its bias);
- q and k are L2-normalised to length sqrt(head_dim), keys scaled per KV head by `qk_norm.temp`,
  then rope (partial, per layer type) and softmax attention (window on "hybrid_sliding" layers).
So a layer keeps, beside its KV pages, the last (cca_time0 - 1) + (cca_time1 - 1) q|k inputs of
the conv and the last delayed value: one RecurrentSpec (conv window `[q + k width, K]`, state
`[kv width / 2]`) served by RecurrentMemory under the model's cache key `num_hidden_layers + i`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import AttentionSpec, RecurrentSpec

from .forward_batch import ForwardBatch
from .rotary import apply_rotary
from .token_shift import lagged_inputs, previous_token


class ZayaCCAProjection(nn.Module):
    """x [T, H] -> q [T, Hq, D], k, v [T, Hkv, D]; HF names (`self_attn.qkv_proj.*`)."""

    def __init__(self, config):
        super().__init__()
        h, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if kv_width % 2:
            raise ValueError(f"num_key_value_heads x head_dim = {kv_width} is odd; Zaya's values are "
                             f"half current, half delayed")
        self.q_width, self.qk_width, self.v_half = q_width, q_width + kv_width, kv_width // 2
        self.window = (config.cca_time0 - 1) + (config.cca_time1 - 1)
        if self.window < 1:
            raise ValueError(f"cca_time0={config.cca_time0}, cca_time1={config.cca_time1}: the q/k "
                             f"convolution must look back at least one token")
        self.q_proj = nn.Linear(h, q_width, bias=bias)
        self.k_proj = nn.Linear(h, kv_width, bias=bias)
        self.v_proj_current = nn.Linear(h, self.v_half, bias=bias)
        self.v_proj_delayed = nn.Linear(h, self.v_half, bias=bias)
        self.conv_qk_depthwise = nn.Conv1d(self.qk_width, self.qk_width, config.cca_time0, groups=self.qk_width)
        self.conv_qk_grouped = nn.Conv1d(self.qk_width, self.qk_width, config.cca_time1,
                                         groups=self.num_heads + self.num_kv_heads)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """Per slot: the conv's last K q|k inputs `[q + k width, K]`; the last delayed value `[kv width / 2]`."""
        return RecurrentSpec(conv_shape=(self.qk_width, self.window), state_shape=(self.v_half,), dtype=dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_pool: torch.Tensor, v_pool: torch.Tensor):
        """conv_pool [S, q + k width, K] and v_pool [S, kv width / 2] are updated in place."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        pq, pk = self.q_proj(x), self.k_proj(x)
        rep = Hq // Hkv
        q_res = (pq.view(T, Hq, D) + pk.view(T, Hkv, 1, D).expand(T, Hkv, rep, D).reshape(T, Hq, D)) * 0.5
        k_res = q_res.view(T, Hkv, rep, D).mean(dim=-2)
        windows = lagged_inputs(torch.cat([pq, pk], dim=-1), conv_pool, batch)  # [T, q + k width, K + 1]
        dw, gw = self.conv_qk_depthwise, self.conv_qk_grouped
        qk = F.conv1d(F.conv1d(windows, dw.weight, dw.bias, groups=dw.groups), gw.weight, gw.bias,
                      groups=gw.groups)[:, :, 0]
        q = qk[:, :self.q_width].reshape(T, Hq, D) + q_res
        k = qk[:, self.q_width:].reshape(T, Hkv, D) + k_res
        delayed = self.v_proj_delayed(x)
        before_first = self.v_proj_delayed(x.new_zeros(1, x.shape[1]))[0]  # transformers' fresh state
        v = torch.cat([self.v_proj_current(x), previous_token(delayed, v_pool, batch, before_first)], dim=-1)
        return q, k, v.view(T, Hkv, D)


class ZayaQKNorm(nn.Module):
    """q, k scaled to L2 norm sqrt(head_dim); keys then times `temp` per KV head."""

    def __init__(self, config):
        super().__init__()
        self.scale = config.head_dim ** 0.5
        self.temp = nn.Parameter(torch.zeros(config.num_key_value_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.finfo(q.dtype).eps
        q = q * (self.scale / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.scale / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, :, None]


class ZayaAttention(nn.Module):
    """`self_attn`: CCA projections, q/k norm, rope, paged attention over this layer's KV group, o_proj."""

    def __init__(self, config, sliding_window):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.sliding_window = sliding_window
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = ZayaCCAProjection(config)
        self.qk_norm = ZayaQKNorm(config)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch, kv_cache: torch.Tensor,
                conv_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """x [T, H] normed, rope (cos, sin) [T, rotary_dim] -> [T, H]; writes this step's K/V."""
        q, k, v = self.qkv_proj(x, batch, conv_pool, v_pool)
        q, k = self.qk_norm(q, k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        block_table, slot_mapping, plans = batch.kv_tables(self.sliding_window)
        ops.write_kv(k, v, kv_cache, slot_mapping, plan_cache=plans)
        out = ops.paged_attention(
            q.contiguous(), kv_cache, batch.query_start_loc, batch.seq_lens, block_table, self.scale,
            causal=True, sliding_window=self.sliding_window,
            max_query_len=max(batch.query_lens_cpu) if batch.query_lens_cpu else None,
            max_seq_len=max(batch.seq_lens_cpu) if batch.seq_lens_cpu else None, plan_cache=plans)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))
