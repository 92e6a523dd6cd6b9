"""MiniMax's lightning attention (linear attention with a per-head decay) over state slots.

Exactly transformers' MiniMaxLightningAttention: `qkv_proj` then silu, laid out per head as
[q, k, v]; a matrix state per head decayed by exp(-slope) each token; the output RMS-normed over
all heads (eps 1e-6), gated by sigmoid(`output_gate`(x)) and projected by `out_proj`. The state
is the only thing kept between steps (no conv window).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch
from .norms import RMSNorm
from .slot_split import SlotSplit, split_decode_prefill


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates [num_heads] (float32, CPU) as MiniMax sets them: ALiBi-like powers
    of 2^(-8/H), scaled down linearly with depth (deeper layers forget more slowly)."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float32, device="cpu") + 1)
    return rate * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)


class LightningAttentionMixer(nn.Module):
    """Token mixer with checkpoint names `qkv_proj`, `output_gate`, `norm`, `out_proj`. The decay
    rates are computed from the layer's depth, never read from the checkpoint (transformers'
    `slope_rate` buffers are derived the same way)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, layer_idx: int,
                 num_layers: int, activation: str = "silu"):
        super().__init__()
        if activation != "silu":
            raise ValueError(f"lightning attention activation {activation!r}; only 'silu' is supported")
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.output_gate = nn.Linear(hidden_size, inner, bias=False)
        self.norm = RMSNorm(inner, eps=1e-6)
        self.out_proj = nn.Linear(inner, hidden_size, bias=False)
        # A plain attribute, not a buffer: models are built on the meta device, this stays real.
        self._slopes = lightning_slopes(num_heads, layer_idx, num_layers)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """Per slot: no conv window, a state `[heads, head_dim, head_dim]` (keys x values)."""
        return RecurrentSpec(conv_shape=(), state_shape=(self.num_heads, self.head_dim, self.head_dim),
                             dtype=dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, state: torch.Tensor,
                split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; state [S, H, D, D] is this layer's pool,
        updated in place at `batch.state_slots`. `split` may be shared across layers."""
        split = split or split_decode_prefill(batch)
        if self._slopes.device != hidden.device:
            self._slopes = self._slopes.to(hidden.device)
        T, H, D = hidden.shape[0], self.num_heads, self.head_dim
        qkv = F.silu(self.qkv_proj(hidden)).view(T, H, 3 * D)

        def decode(x, s):
            q, k, v = torch.split(x, D, dim=-1)
            return ops.lightning_state_update(state, q, k, v, self._slopes, s.decode_slots)

        def prefill(x, s):
            q, k, v = torch.split(x, D, dim=-1)
            return ops.lightning_chunk_scan(state, q, k, v, self._slopes, s.prefill_qsl,
                                            s.prefill_slots, s.prefill_has_init)

        core = split.run(qkv, decode=decode, prefill=prefill, states=(state,))  # [T, H, D]
        core = self.norm(core.reshape(T, H * D))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * core)
