"""Mixture of experts in torch: pairs sorted by expert, one grouped matmul per projection.

No per-expert host sync: the sort, the per-expert offsets and `torch._grouped_mm` take their
sizes from shapes. Where `_grouped_mm` is missing (torch < 2.8) or rejects the inputs, a loop over
the experts' slices runs instead, after one read of the counts (the only host sync, per call).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import backend_for
from .fused_moe_ref import activation_fn, check_expert_ids, check_fused_moe_inputs, check_moe_extras, clamped_swiglu
from .moe_sort import expert_counts


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [M, K] whose rows run by expert (expert e's end row: ends [E] int32, a cumsum of the
    counts), w [E, N, K] -> [M, N]: each run @ w[e].T."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None:
        try:
            return grouped(x, w.transpose(1, 2), offs=ends)
        except (RuntimeError, NotImplementedError):  # a dtype / device this build does not cover
            pass
    stops = ends.tolist()
    return torch.cat([F.linear(x[start:stop], w[e])
                      for e, (start, stop) in enumerate(zip([0] + stops[:-1], stops)) if stop > start])


def fused_moe_torch(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation: str = "silu",
                    gated: bool = True, gate_up_bias=None, down_bias=None, swiglu=None, glu=None):
    """Same contract as `fused_moe_ref`: hidden [T, H], w_gate_up [E, 2I, H] ([E, I, H] when not
    gated), w_down [E, H, I], topk_weights / topk_ids [T, k] -> [T, H] in hidden's dtype;
    optional gate_up_bias [E, 2I], down_bias [E, H], swiglu=(alpha, limit) (GPT-OSS), glu: a
    callable (gate, up) -> inner [M, I] replacing act(gate) * up (Inkling 2's softcapped SwiGLU)."""
    check_fused_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids, gated)
    check_moe_extras(w_gate_up, w_down, gate_up_bias, down_bias, swiglu, gated)
    # free on the CPU; a host sync on a GPU and in a decode graph's dry run (Triton backend forced)
    if backend_for(hidden) == "torch" and not hidden.is_cuda:
        check_expert_ids(topk_ids, w_gate_up.shape[0])
    T, H = hidden.shape
    k = topk_ids.shape[1]
    act = activation_fn(activation)
    if T == 0:
        return hidden.new_zeros(0, H)
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    ends = expert_counts(topk_ids, w_gate_up.shape[0]).cumsum(0).to(torch.int32)
    x = hidden[order // k]
    inner = _grouped_linear(x, w_gate_up, ends)
    experts = flat[order] if gate_up_bias is not None or down_bias is not None else None
    if gate_up_bias is not None:
        inner = inner + gate_up_bias[experts].to(inner.dtype)
    if gated:
        gate, up = inner.chunk(2, dim=-1)
        if glu is not None:
            inner = glu(gate, up)
        else:
            inner = clamped_swiglu(gate, up, *swiglu) if swiglu is not None else act(gate) * up
    else:
        inner = act(inner)
    y = _grouped_linear(inner, w_down, ends)
    if down_bias is not None:
        y = y + down_bias[experts].to(y.dtype)
    y = y * topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
    per_pair = torch.empty_like(y)
    per_pair.index_copy_(0, order, y)
    if k == 1:
        return per_pair
    return per_pair.view(T, k, H).sum(dim=1, dtype=torch.float32).to(hidden.dtype)  # as the kernel
