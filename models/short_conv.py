"""LFM2's gated short convolution over state slots: a depthwise causal conv gated on both sides.

The only recurrent state is the conv window (the last k-1 gated inputs `B * x`), so the layer's
RecurrentSpec has an empty state_shape. Prefill chunks go through `causal_conv1d`, decodes through
`conv1d_update`; both read and write the window in place through the requests' slots.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch
from .row_parallel import RowParallel
from .slot_split import SlotSplit, split_decode_prefill


class ShortConv(RowParallel, nn.Module):
    """in_proj -> [B | C | x]; conv(B * x) causal depthwise, no activation; y = C * conv; out_proj.

    hidden_size: model width (also the conv width); kernel_size: taps of the conv (LFM2's
    `conv_L_cache`); bias: one flag for conv, in_proj and out_proj (LFM2's `conv_bias`).
    Parameter names follow transformers' Lfm2ShortConv (conv, in_proj, out_proj).
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False):
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"short-conv kernel size (conv_L_cache) is {kernel_size}; it must be >= 2 "
                             f"so the layer keeps a window of at least one past token")
        self.hidden_size, self.kernel_size = hidden_size, kernel_size
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias,
                              padding=kernel_size - 1)
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """Per slot: the conv window `[hidden_size, kernel_size - 1]`; no SSM state."""
        return RecurrentSpec(conv_shape=(self.hidden_size, self.kernel_size - 1), state_shape=(),
                             dtype=dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        conv_state [S, hidden_size, kernel_size-1] is this layer's pool, updated in place at
        `batch.state_slots`. `split` (decode vs prefill rows) may be shared by all layers of a step.
        """
        split = split or split_decode_prefill(batch)
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        bx = (B * x).contiguous()
        weight = self.conv.weight.squeeze(1)  # [hidden, k]
        bias = self.conv.bias

        def decode(rows, sp):
            return ops.conv1d_update(rows, conv_state, weight, bias, sp.decode_slots, activation=None)

        def prefill(rows, sp):
            return ops.causal_conv1d(rows.contiguous(), conv_state, weight, bias, sp.prefill_qsl,
                                     sp.prefill_slots, sp.prefill_has_init, activation=None)

        conv_out = split.run(bx, decode, prefill, states=(conv_state,))
        return self.rank_sum(self.out_proj(C * conv_out.to(C.dtype)))
