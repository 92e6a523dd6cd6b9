"""The gated feed-forward block: down(act(gate(x)) * up(x)), gate and up as one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused_linear import FusedLinear
from .row_parallel import RowParallel


class GatedMLP(RowParallel, nn.Module):
    """x [T, hidden] -> [T, hidden]; parameter names gate_proj / up_proj / down_proj as in HF."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]
        self.gate_up = FusedLinear((self.gate_proj, self.up_proj))  # one matmul per step
        self.down = FusedLinear((self.down_proj,))  # (its CPU layout)
        self._silu = act == "silu"  # most checkpoints: in place, without a module call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, *self.gate_up.weight_bias())
        n = self.gate_up.sizes[0]
        gate, up = gate_up[..., :n], gate_up[..., n:]  # (two slices cost less than a split)
        gate = F.silu(gate, inplace=True) if self._silu else self.act_fn(gate)  # gate: a fresh output
        if self.down.linears[0] is not self._modules["down_proj"]:  # replaced since
            self.down = FusedLinear((self._modules["down_proj"],))
        return self.rank_sum(F.linear(gate.mul_(up), *self.down.weight_bias()))
