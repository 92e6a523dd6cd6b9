"""Inkling 2's attention layers: Inkling's relative-bias attention over paged KV
(`relative_attention`) with clipped projections, a per-query sink and a gated output.

As transformers' Inkling2SlidingAttention / Inkling2FullAttention (HF names):
- q = clip(linear(x) * scale) per head (L2 norm at most `qk_l2_clip_threshold`); full layers then
  times tau = 1 + alpha log(max(1, (pos + 1) / log_scaling_n_floor)) (`q_proj.norm.log_scale`);
- k = clip(sconv(linear(x_k))), v = unweighted_rmsnorm(sconv(linear(x_v))) per head: sliding
  layers' convs are static ((x + conv(x)) / sqrt(K + 1)), full layers' add per-token taps projected
  from the conv's input, shared within a KV head ((x + conv(x)) / sqrt(2K + 1));
- relative bias as Inkling's, its states clipped (`rel_l2_clip_threshold`) and, on full layers,
  log-scaled; a sink logit per query and head (`sink_proj`) in the softmax; scores times
  head_dim ** -0.5; output sigmoid-gated from the query input (`o_proj.gate_proj`), then `o_proj.linear`.
The conv windows (the last K - 1 linear outputs of k and v, float32) are views of the layer's
state slot (models/inkling2.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import AttentionSpec

from .forward_batch import ForwardBatch
from .inkling_attention import InklingShortConv, relative_attention
from .token_shift import lagged_inputs


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """x [..., d] float32 -> x scaled down to L2 norm `threshold` where it is longer."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + 1e-6)).clamp(max=1.0)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def log_scale(positions: torch.Tensor, config) -> torch.Tensor:
    """positions [T] -> tau [T] float32 (Inkling2LogScale)."""
    return 1.0 + config.log_scaling_alpha * torch.log(((positions + 1).float() / config.log_scaling_n_floor).clamp(min=1.0))


class ScaledClip(nn.Module):
    """`norm` of q_proj / relative_position_bias: clip(x * scale) per head, then (full layers) x tau.
    The log-scaled form keeps its clip and scale under `l2_clip` / `scale` as transformers."""

    def __init__(self, heads: int, dim: int, threshold: float, log_scaling: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(heads, dim))
        self.threshold, self.log_scaling = threshold, log_scaling

    def forward(self, x: torch.Tensor, tau: torch.Tensor | None) -> torch.Tensor:
        y = l2_clip(x.float() * self.scale.float(), self.threshold).to(x.dtype)
        return y if not self.log_scaling else (y.float() * tau[:, None, None]).to(x.dtype)


class ClippedProjection(nn.Module):
    """`q_proj` / `relative_position_bias` states: linear, heads, ScaledClip."""

    def __init__(self, hidden: int, heads: int, dim: int, threshold: float, log_scaling: bool):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.linear = nn.Linear(hidden, heads * dim, bias=False)
        self.norm = ScaledClip(heads, dim, threshold, log_scaling)

    def forward(self, x: torch.Tensor, tau) -> torch.Tensor:
        return self.norm(self.linear(x).view(x.shape[0], self.heads, self.dim), tau)


class DynamicShortConv(nn.Module):
    """Taps = `static_weight` [K, C] (tap 0: the current token) + per-token taps `weight_proj(input)`
    shared by the channels of a KV head; (x + conv(x)) / sqrt(2K + 1), in float32."""

    def __init__(self, channels: int, input_size: int, heads: int, kernel_size: int):
        super().__init__()
        self.channels, self.heads, self.kernel_size = channels, heads, kernel_size
        self.static_weight = nn.Parameter(torch.zeros(kernel_size, channels))
        self.weight_proj = nn.Linear(input_size, heads * kernel_size, bias=False)

    def forward(self, x: torch.Tensor, dynamic_input: torch.Tensor, window: torch.Tensor, batch: ForwardBatch):
        T, K, H = x.shape[0], self.kernel_size, self.heads
        taps = self.static_weight.float().T.view(H, -1, K) + self.weight_proj(dynamic_input).float().view(T, H, 1, K)
        xf = x.float()
        lagged = lagged_inputs(xf, window, batch).flip(-1).view(T, H, -1, K)  # [..., lag]: lag tokens back
        y = (lagged * taps).sum(-1).reshape(T, -1)
        return ((y + xf) / math.sqrt(2 * K + 1)).to(x.dtype)


class KeyValueProjection(nn.Module):
    """`k_proj` / `v_proj`: linear, short conv (static or dynamic), per head clip (keys) or
    unweighted RMSNorm (values)."""

    def __init__(self, config, heads: int, head_dim: int, is_key: bool, dynamic: bool):
        super().__init__()
        h, k = config.hidden_size, config.conv_kernel_size
        self.heads, self.head_dim, self.is_key = heads, head_dim, is_key
        self.clip, self.eps = config.qk_l2_clip_threshold, config.rms_norm_eps
        self.linear = nn.Linear(h, heads * head_dim, bias=False)
        self.sconv = (DynamicShortConv(heads * head_dim, h, heads, k) if dynamic
                      else InklingShortConv(heads * head_dim, k, divisor=math.sqrt(k + 1)))

    def forward(self, x: torch.Tensor, window: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        y = self.linear(x)
        if isinstance(self.sconv, DynamicShortConv):
            y = self.sconv(y, x, window, batch)
        else:
            y = self.sconv(y, window, batch)
        y = y.view(x.shape[0], self.heads, self.head_dim)
        return l2_clip(y.float(), self.clip).to(y.dtype) if self.is_key else unweighted_rms_norm(y, self.eps)


class GatedOutput(nn.Module):
    """`o_proj`: linear(attention output * sigmoid(gate_proj(query input)))."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.linear = nn.Linear(width, hidden, bias=False)

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_proj(x).float())
        return self.linear((out.float() * gate).to(out.dtype))


class RelativePositionBias(ClippedProjection):
    """`relative_position_bias`: clipped per-head states mixing the bank `proj` [d_rel, extent]."""

    def __init__(self, config, heads: int, extent: int, log_scaling: bool):
        super().__init__(config.hidden_size, heads, config.d_rel, config.rel_l2_clip_threshold, log_scaling)
        self.proj = nn.Parameter(torch.empty(config.d_rel, extent))

    def forward(self, x: torch.Tensor, tau) -> torch.Tensor:
        return super().forward(x, tau) @ self.proj  # [T, heads, extent]


class Inkling2Attention(nn.Module):
    """`self_attn` of a sliding layer (static convs) or a full one (dynamic convs, log scaling)."""

    def __init__(self, config, sliding: bool):
        super().__init__()
        p = "swa_" if sliding else ""
        self.num_heads = getattr(config, f"{p}num_attention_heads")
        self.num_kv_heads = getattr(config, f"{p}num_key_value_heads")
        self.head_dim = getattr(config, f"{p}head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{p}num_attention_heads={self.num_heads} is not a multiple of "
                             f"{p}num_key_value_heads={self.num_kv_heads}")
        self.config, self.sliding = config, sliding
        self.sliding_window = config.sliding_window_size if sliding else None
        self.kv_width = self.num_kv_heads * self.head_dim
        h, width = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = ClippedProjection(h, self.num_heads, self.head_dim, config.qk_l2_clip_threshold, not sliding)
        self.k_proj = KeyValueProjection(config, self.num_kv_heads, self.head_dim, True, dynamic=not sliding)
        self.v_proj = KeyValueProjection(config, self.num_kv_heads, self.head_dim, False, dynamic=not sliding)
        self.o_proj = GatedOutput(h, width)
        self.sink_proj = nn.Linear(h, self.num_heads, bias=False)
        extent = config.sliding_window_size if sliding else config.rel_extent
        self.relative_position_bias = RelativePositionBias(config, self.num_heads, extent, not sliding)

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window)

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, batch: ForwardBatch,
                kv_cache: torch.Tensor, k_window: torch.Tensor, v_window: torch.Tensor) -> torch.Tensor:
        """xq, xk, xv [T, H] normed inputs of the query (also of bias, sinks and gate), key and value."""
        tau = None if self.sliding else log_scale(batch.positions, self.config)
        q = self.q_proj(xq, tau)
        k = self.k_proj(xk, k_window, batch)
        v = self.v_proj(xv, v_window, batch)
        rel = self.relative_position_bias(xq, tau)
        block_table, slot_mapping, plans = batch.kv_tables(self.sliding_window)
        ops.write_kv(k.contiguous(), v.contiguous(), kv_cache, slot_mapping, plan_cache=plans)
        out = relative_attention(q, rel, kv_cache, batch, block_table, self.sliding_window, self.head_dim ** -0.5,
                                 None, sinks=self.sink_proj(xq))
        return self.o_proj(out.reshape(xq.shape[0], -1), xq)
