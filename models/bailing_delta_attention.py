"""Ling 3 (BailingHybrid) delta attention: Kimi delta attention with a bounded forget gate.

Differs from Kimi-Linear's KDA (models/kda_mixer.py) only in two projections, as transformers'
BailingHybridDeltaAttention does: the forget gate is one `f_proj` (not f_a / f_b) squashed to
[kda_lower_bound, 0] by a sigmoid ("safe gate"; without it -exp(A_log) * softplus as in Kimi), with
one A_log per head; the output gate is one `g_proj` (not g_a / g_b). State, conv window and scans
are KDA's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kda_mixer import KimiDeltaAttentionMixer


class BoundedForgetGate(nn.Module):
    """x [T, hidden] -> per-channel log-decay g [T, H, K] (float32): lower_bound * sigmoid(exp(A_log)
    * (f_proj(x) + dt_bias)) when `safe`, else -exp(A_log) * softplus(f_proj(x) + dt_bias)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, safe: bool, lower_bound: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.safe, self.lower_bound = safe, lower_bound
        self.f_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(num_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = (self.f_proj(x).float() + self.dt_bias.float()).view(x.shape[0], self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, self.num_heads, 1)
        if self.safe:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * F.softplus(g)


class BailingDeltaAttentionMixer(KimiDeltaAttentionMixer):
    """KDA with transformers' BailingHybrid names: q_proj, k_proj, v_proj, conv1d,
    forget_gate.{f_proj, dt_bias, A_log}, b_proj, g_proj, o_norm, o_proj."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float,
                 activation: str, safe_gate: bool, lower_bound: float):
        super().__init__(hidden_size, num_heads, head_dim, conv_kernel, eps, activation)
        del self.g_a_proj, self.g_b_proj
        self.forget_gate = BoundedForgetGate(hidden_size, num_heads, head_dim, safe_gate, lower_bound)
        self.g_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)

    def output_gate(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.g_proj(hidden)
