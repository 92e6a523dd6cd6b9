"""Sparse mixture of experts with top-k routing, optionally with a gated shared expert.

Routing follows transformers exactly: softmax over all experts in float32, top-k of the
probabilities, then (when `norm_topk_prob`) renormalise the k chosen weights to sum to 1.
Jamba: no renormalisation, no shared expert. Qwen3-Next / Qwen3.5-MoE: renormalisation and a shared
expert scaled by sigmoid(shared_expert_gate(x)). GraniteMoeHybrid: softmax over the top-k logits,
the same as renormalising. The experts run as one fused op over stacked weights
(`hybridkv.kernels.fused_moe`: Triton on CUDA, a grouped matmul in torch on CPU), no host sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops

from .mlp import GatedMLP
from .row_parallel import RowParallel


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] long)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def published_router_name(name: str) -> str:
    """The checkpoint name of parameter `name` for families whose router the checkpoint calls
    `mlp.gate` (Qwen3-Next, Qwen3.5-MoE, MiniMax, LaraMini): SparseMoE names it `mlp.router`."""
    return name.replace(".mlp.router.", ".mlp.gate.") if ".mlp.router." in name else name


class StackedExperts(nn.Module):
    """The experts' weights as transformers holds them in memory: `gate_up_proj [E, 2I, H]` (gate
    rows, then up rows) and `down_proj [E, H, I]`, the layout the fused MoE kernels read."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)


class SparseMoE(RowParallel, nn.Module):
    """hidden [T, H] -> [T, H]. Weight names: `router`, `experts.{gate_up_proj,down_proj}`,
    `shared_expert.*`, `shared_expert_gate` (families rename their checkpoint keys onto these;
    per-expert checkpoints load through PerExpertView)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate_size: int = 0, act: str = "silu"):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.act = act
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if shared_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act=act)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (weights [T, k] float32, expert ids [T, k]); families with another
        router (sigmoid, expert bias) override this alone."""
        return route(self.router(hidden), self.top_k, self.norm_topk_prob)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)
        out = ops.fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj,
                            weights.to(hidden.dtype), ids, self.act)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return self.rank_sum(out)  # one sum for routed + shared (the gate is per token)


class PerExpertView:
    """A checkpoint seen with transformers' stacked expert names (`...experts.gate_up_proj`
    [E, 2I, H] = gate|up, `...experts.down_proj` [E, H, I]) even when it stores the published
    per-expert tensors (`...experts.E.{gate,up,down}_proj.weight`). Wraps anything with
    `__contains__` and `get(name)`."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _per_expert(self, name: str):
        """(prefix, parts) when `name` is a stacked expert tensor absent as such but stored per expert."""
        head, sep, tail = name.rpartition(".experts.")
        if not sep or tail not in ("gate_up_proj", "down_proj") or name in self.ckpt:
            return None
        parts = ("down_proj",) if tail == "down_proj" else ("gate_proj", "up_proj")
        prefix = f"{head}.experts"
        return (prefix, parts) if f"{prefix}.0.{parts[0]}.weight" in self.ckpt else None

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt or self._per_expert(name) is not None

    def get(self, name: str) -> torch.Tensor:
        found = self._per_expert(name)
        if found is None:
            return self.ckpt.get(name)  # raises the checkpoint's own "missing tensor" error
        prefix, parts = found
        stacked, e = [], 0
        while f"{prefix}.{e}.{parts[0]}.weight" in self.ckpt:
            stacked.append(torch.cat([self.ckpt.get(f"{prefix}.{e}.{p}.weight") for p in parts]))
            e += 1
        return torch.stack(stacked)
