"""The gated feed-forward block: down(act(gate(x)) * up(x))."""
from __future__ import annotations

import torch
from torch import nn


class GatedMLP(nn.Module):
    """x [T, hidden] -> [T, hidden]; parameter names gate_proj / up_proj / down_proj as in HF."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
