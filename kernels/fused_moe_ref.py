"""Mixture-of-experts feed-forward from routed tokens: the torch reference (the specification).

Expert weights are stacked as transformers keeps them in memory: `w_gate_up [E, 2I, H]` (the gate
rows, then the up rows) and `w_down [E, H, I]`. Token t goes to experts `topk_ids[t, :]` with
weights `topk_weights[t, :]`; its output is sum_j w[t, j] * down_e(act(gate_e x) * up_e x).
With `gated=False` (Nemotron-H's relu2 experts) `w_gate_up` is the up rows alone, [E, I, H], and an
expert computes down_e(act(up_e x)).
GPT-OSS: `gate_up_bias [E, 2I]` and `down_bias [E, H]` add to the projections, and
`swiglu=(alpha, limit)` replaces act(gate) * up with clamped_swiglu(gate, up, alpha, limit).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def activation_fn(name: str):
    """transformers' activation `name` ("silu", "gelu", ...) as a callable (ACT2FN builds a new
    module per lookup; cached)."""
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"activation={name!r} is unknown; transformers knows {sorted(ACT2FN)}")
    return ACT2FN[name]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert activation: gate clamped to <= limit, up to [-limit, limit];
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def check_moe_extras(w_gate_up, w_down, gate_up_bias, down_bias, swiglu, gated) -> None:
    """Bias shapes and swiglu=(alpha, limit); ValueError naming the value and what was expected."""
    E, H = w_down.shape[0], w_down.shape[1]
    for name, b, want in (("gate_up_bias", gate_up_bias, (E, w_gate_up.shape[1])), ("down_bias", down_bias, (E, H))):
        if b is not None and tuple(b.shape) != want:
            raise ValueError(f"{name} has shape {tuple(b.shape)}; expected {want}")
    if swiglu is not None:
        if not gated:
            raise ValueError("swiglu=(alpha, limit) needs gated experts (w_gate_up holds gate and up rows)")
        alpha, limit = swiglu
        if not limit > 0:
            raise ValueError(f"swiglu limit={limit}; must be > 0")


def check_fused_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids, gated=True) -> None:
    """Shapes and dtypes only (no host sync); ValueError naming the value and what was expected."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}; expected [tokens, hidden_size]")
    T, H = hidden.shape
    rows = 2 if gated else 1
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != H or w_gate_up.shape[1] % rows:
        raise ValueError(f"w_gate_up has shape {tuple(w_gate_up.shape)}; expected [experts, "
                         f"{'2 * ' if gated else ''}intermediate, hidden_size={H}]")
    E, I = w_gate_up.shape[0], w_gate_up.shape[1] // rows
    if tuple(w_down.shape) != (E, H, I):
        raise ValueError(f"w_down has shape {tuple(w_down.shape)}; expected (experts, hidden_size, "
                         f"intermediate) = {(E, H, I)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)} and dtype {topk_ids.dtype}; "
                         f"expected integer [tokens={T}, top_k]")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}; expected "
                         f"{tuple(topk_ids.shape)} like topk_ids")
    if not 0 < topk_ids.shape[1] <= E:
        raise ValueError(f"top_k={topk_ids.shape[1]} must be in [1, experts={E}]")


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """ValueError when an id is outside [0, num_experts) (reads the ids: a host sync on a GPU)."""
    if not topk_ids.numel():
        return
    low, high = (int(v) for v in torch.aminmax(topk_ids))
    if low < 0 or high >= num_experts:
        raise ValueError(f"topk_ids hold values in [{low}, {high}]; expert ids must be in "
                         f"[0, {num_experts})")


def fused_moe_ref(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation: str = "silu",
                  gated: bool = True, gate_up_bias=None, down_bias=None, swiglu=None):
    """hidden [T, H], w_gate_up [E, 2I, H] ([E, I, H] when not gated), w_down [E, H, I],
    topk_weights [T, k], topk_ids [T, k] -> [T, H] in hidden's dtype. Every expert runs on every
    token in float32 (slow, obviously right)."""
    check_fused_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids, gated)
    check_expert_ids(topk_ids, w_gate_up.shape[0])
    check_moe_extras(w_gate_up, w_down, gate_up_bias, down_bias, swiglu, gated)
    act = activation_fn(activation)
    x = hidden.float()
    proj = torch.einsum("th,eih->eti", x, w_gate_up.float())                      # [E, T, 2I or I]
    if gate_up_bias is not None:
        proj = proj + gate_up_bias.float()[:, None]
    if gated:
        gate, up = proj.chunk(2, dim=-1)
        inner = clamped_swiglu(gate, up, *swiglu) if swiglu is not None else act(gate) * up
    else:
        inner = act(proj)
    every = torch.einsum("eti,ehi->eth", inner, w_down.float())                    # [E, T, H]
    if down_bias is not None:
        every = every + down_bias.float()[:, None]
    rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
    picked = every[topk_ids.long(), rows]                                          # [T, k, H]
    return (picked * topk_weights.float()[..., None]).sum(dim=1).to(hidden.dtype)
