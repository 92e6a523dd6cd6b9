"""Kimi delta attention (KDA) over state slots: Kimi-Linear's linear-attention layer.

Exactly transformers' KimiLinearDeltaAttention: q, k, v projections through one depthwise causal
conv (silu) over [q | k | v]; a per-channel forget gate g = -exp(A_log) * softplus(f_b(f_a(x)) +
dt_bias); beta = sigmoid(b_proj(x)); the gated delta rule with L2-normalised q, k; the output
RMS-normed per head (fp32 weight) and gated by sigmoid(g_b(g_a(x))), then o_proj. Kept between
steps: the conv window `[3 * H * K, k-1]` and the state `[H, K, K]` (float32, as transformers keeps it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch
from .slot_split import SlotSplit, split_decode_prefill


class KimiForgetGate(nn.Module):
    """x [T, hidden] -> per-channel log-decay g [T, H, K] (float32, <= 0)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))  # transformers' shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = F.softplus(g).view(x.shape[0], self.num_heads, self.head_dim)
        return -self.A_log.float().exp().view(1, self.num_heads, 1) * g


class SigmoidGatedRMSNorm(nn.Module):
    """o, gate [..., dim] -> rms_norm(o) * w * sigmoid(gate), all in float32, cast back to o's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(o.dtype)


class KimiDeltaAttentionMixer(nn.Module):
    """Token mixer with transformers' in-memory names (q_proj, k_proj, v_proj, conv1d,
    forget_gate.*, b_proj, g_a_proj, g_b_proj, o_norm, o_proj)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int,
                 eps: float, activation: str = "silu"):
        super().__init__()
        if activation != "silu":
            raise ValueError(f"KDA conv activation {activation!r}; only 'silu' is supported")
        self.num_heads, self.head_dim, self.conv_kernel = num_heads, head_dim, conv_kernel
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.conv_dim = 3 * inner
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                bias=False, padding=conv_kernel - 1)
        self.forget_gate = KimiForgetGate(hidden_size, num_heads, head_dim)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, inner, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)

    def output_gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> the output gate's logits [T, H * K] (a family may project it otherwise)."""
        return self.g_b_proj(self.g_a_proj(hidden))

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """Per slot: conv window `[3 * H * K, k-1]`, state `[H, K, K]` kept in float32."""
        return RecurrentSpec(conv_shape=(self.conv_dim, self.conv_kernel - 1),
                             state_shape=(self.num_heads, self.head_dim, self.head_dim), dtype=dtype,
                             state_dtype=None if dtype == torch.float32 else torch.float32)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                state: torch.Tensor, split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]. conv_state [S, 3HK, k-1] and state
        [S, H, K, K] are this layer's pools, updated in place at `batch.state_slots`."""
        split = split or split_decode_prefill(batch)
        T, H, K = hidden.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        mixed = split.run(
            mixed,
            decode=lambda xd, s: ops.conv1d_update(xd, conv_state, weight, None, s.decode_slots),
            prefill=lambda xp, s: ops.causal_conv1d(xp, conv_state, weight, None, s.prefill_qsl,
                                                    s.prefill_slots, s.prefill_has_init),
            states=(conv_state,),
        )
        g = self.forget_gate(hidden)
        beta = torch.sigmoid(self.b_proj(hidden).float())
        # One packed row per token so the split gathers every per-token input at once.
        packed = torch.cat([mixed.float(), g.reshape(T, H * K), beta], dim=-1)

        def unpack(p):
            n = p.shape[0]
            q, k, v, gs = (p[:, j * H * K:(j + 1) * H * K].reshape(n, H, K) for j in range(4))
            return q, k, v, gs, p[:, 4 * H * K:]

        def decode(p, s):
            q, k, v, gs, bs = unpack(p)
            return ops.kda_state_update(state, q, k, v, gs, bs, s.decode_slots, use_qk_l2norm=True)

        def prefill(p, s):
            q, k, v, gs, bs = unpack(p)
            return ops.kda_chunk_scan(state, q, k, v, gs, bs, s.prefill_qsl, s.prefill_slots,
                                      s.prefill_has_init, use_qk_l2norm=True)

        core = split.run(packed, decode=decode, prefill=prefill, states=(state,))  # [T, H, K]
        gate = self.output_gate(hidden).view(T, H, K)
        out = self.o_norm(core.to(hidden.dtype), gate)
        return self.o_proj(out.reshape(T, H * K))
