"""Sparse mixture of experts with top-k routing, optionally with a gated shared expert.

Routing follows transformers exactly: softmax over all experts in float32, top-k of the
probabilities, then (when `norm_topk_prob`) renormalise the k chosen weights to sum to 1.
Jamba: no renormalisation, no shared expert. Qwen3-Next: renormalisation and a shared expert
scaled by sigmoid(shared_expert_gate(x)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import GatedMLP


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] long)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """hidden [T, H] -> [T, H]. Weight names: `router`, `experts.{i}.{gate,up,down}_proj`,
    `shared_expert.*`, `shared_expert_gate` (families rename their checkpoint keys onto these)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate_size: int = 0, act: str = "silu"):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, intermediate_size, act=act) for _ in range(num_experts))
        self.shared_expert = None
        self.shared_expert_gate = None
        if shared_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act=act)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(hidden), self.top_k, self.norm_topk_prob)
        weights = weights.to(hidden.dtype)
        out = torch.zeros_like(hidden)
        # A loop over the experts that received tokens: fine on CPU and for small batches.
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            y = self.experts[e](hidden[tok]) * weights[tok, slot, None]
            out.index_put_((tok,), y.to(out.dtype), accumulate=True)  # index_add_ is slow on CPU
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out


class PerExpertView:
    """A checkpoint seen with per-expert names (`...experts.E.gate_proj.weight`) even when it stores
    transformers' fused expert tensors (`...experts.gate_up_proj` [E, 2I, H] = gate|up,
    `...experts.down_proj` [E, H, I]). Wraps anything with `__contains__` and `get(name)`."""

    _PARTS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _fused(self, name: str):
        """(fused tensor name, expert, part) when `name` is a per-expert weight absent as such."""
        head, sep, tail = name.rpartition(".experts.")
        pieces = tail.split(".")
        if not sep or len(pieces) != 3 or pieces[1] not in self._PARTS or pieces[2] != "weight":
            return None
        fused = f"{head}.experts.{'down_proj' if pieces[1] == 'down_proj' else 'gate_up_proj'}"
        return (fused, int(pieces[0]), pieces[1]) if fused in self.ckpt else None

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt or self._fused(name) is not None

    def get(self, name: str) -> torch.Tensor:
        if name in self.ckpt:
            return self.ckpt.get(name)
        found = self._fused(name)
        if found is None:
            return self.ckpt.get(name)  # raises the checkpoint's own "missing tensor" error
        fused, e, part = found
        tensor = self.ckpt.get(fused)[e]
        if part == "down_proj":
            return tensor
        gate, up = tensor.chunk(2, dim=0)
        return gate if part == "gate_proj" else up
