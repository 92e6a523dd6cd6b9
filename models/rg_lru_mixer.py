"""RecurrentGemma's recurrent block over state slots: a gelu branch times conv1d -> RG-LRU.

    y = gelu_tanh(linear_y(x));  u = conv_1d(linear_x(x));  out = linear_out(rg_lru(u) * y)

Per request it keeps the conv window (the last k-1 inputs of the conv, `[lru_width, k-1]`) and
the RG-LRU state (`[lru_width]`, float32 as in transformers). Prefill chunks go through
`causal_conv1d` and the varlen RG-LRU scan, decodes through `conv1d_update` and the one-token
RG-LRU step (`ops.rg_lru_state_update`: Triton on CUDA); both read and write the pools in place through
the requests' slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch
from .slot_split import SlotSplit, split_decode_prefill


class RGLRU(nn.Module):
    """The gates of the RG-LRU: block-diagonal (one `block_width` square per head) input and
    recurrence gates. Parameter names follow transformers' RecurrentGemmaRglru."""

    def __init__(self, lru_width: int, num_heads: int):
        super().__init__()
        if lru_width % num_heads:
            raise ValueError(f"lru_width={lru_width} is not a multiple of num_attention_heads="
                             f"{num_heads}; the RG-LRU gates are one square block per head")
        self.num_heads, self.block_width = num_heads, lru_width // num_heads
        bw = self.block_width
        self.recurrent_param = nn.Parameter(torch.empty(lru_width))
        self.input_gate_weight = nn.Parameter(torch.empty(num_heads, bw, bw))
        self.input_gate_bias = nn.Parameter(torch.empty(num_heads, bw))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(num_heads, bw, bw))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(num_heads, bw))

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, lru_width] -> (input gate, recurrence gate), each sigmoid'ed [T, lru_width]."""
        T = x.shape[0]
        per_head = x.reshape(T, self.num_heads, self.block_width).transpose(0, 1)  # [H, T, bw]
        gi = torch.baddbmm(self.input_gate_bias[:, None, :], per_head, self.input_gate_weight)
        gr = torch.baddbmm(self.recurrent_gate_bias[:, None, :], per_head, self.recurrent_gate_weight)
        return (torch.sigmoid(gi.transpose(0, 1).reshape(T, -1)),
                torch.sigmoid(gr.transpose(0, 1).reshape(T, -1)))


class RGLRUBlock(nn.Module):
    """hidden_size: model width; lru_width: recurrence width; num_heads: gate blocks;
    conv_width: taps of the depthwise conv. Names follow transformers' RecurrentGemmaRecurrentBlock."""

    def __init__(self, hidden_size: int, lru_width: int, num_heads: int, conv_width: int):
        super().__init__()
        if conv_width < 2:
            raise ValueError(f"conv1d_width is {conv_width}; it must be >= 2")
        self.lru_width, self.conv_width = lru_width, conv_width
        self.linear_y = nn.Linear(hidden_size, lru_width)
        self.linear_x = nn.Linear(hidden_size, lru_width)
        self.linear_out = nn.Linear(lru_width, hidden_size)
        self.conv_1d = nn.Conv1d(lru_width, lru_width, conv_width, groups=lru_width,
                                 padding=conv_width - 1)
        self.rg_lru = RGLRU(lru_width, num_heads)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """Per slot: conv window `[lru_width, conv_width - 1]`; RG-LRU state `[lru_width]` in float32."""
        return RecurrentSpec(conv_shape=(self.lru_width, self.conv_width - 1),
                             state_shape=(self.lru_width,), dtype=dtype,
                             state_dtype=None if dtype == torch.float32 else torch.float32)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                lru_state: torch.Tensor, split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        conv_state [S, lru_width, conv_width-1] and lru_state [S, lru_width] are this layer's
        pools, updated in place at `batch.state_slots`. `split` may be shared across layers.
        """
        split = split or split_decode_prefill(batch)
        y = F.gelu(self.linear_y(hidden), approximate="tanh")
        x = self.linear_x(hidden)
        weight, bias = self.conv_1d.weight.squeeze(1), self.conv_1d.bias
        x = split.run(
            x,
            decode=lambda xd, s: ops.conv1d_update(xd, conv_state, weight, bias, s.decode_slots,
                                                   activation=None),
            prefill=lambda xp, s: ops.causal_conv1d(xp.contiguous(), conv_state, weight, bias,
                                                    s.prefill_qsl, s.prefill_slots, s.prefill_has_init,
                                                    activation=None),
            states=(conv_state,),
        )
        gi, gr = self.rg_lru.gates(x)
        packed = torch.cat([x, gi, gr], dim=-1)
        param = self.rg_lru.recurrent_param

        def decode(p, s):
            return ops.rg_lru_state_update(lru_state, *p.chunk(3, dim=-1), param, s.decode_slots)

        def prefill(p, s):
            return ops.rg_lru_scan(lru_state, *p.chunk(3, dim=-1), param, s.prefill_qsl,
                                   s.prefill_slots, s.prefill_has_init)

        h = split.run(packed, decode=decode, prefill=prefill, out_dim=self.lru_width, states=(lru_state,))
        return self.linear_out(h.to(hidden.dtype) * y)
