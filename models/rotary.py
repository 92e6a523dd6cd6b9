"""Rotary position embedding (neox / rotate-half layout) with transformers' rope-parameter conventions."""
from __future__ import annotations

import torch
from torch import nn

# rope types whose frequencies change with the running sequence length: not supported here.
_DYNAMIC = ("dynamic", "longrope")


def _rope_parameters(config) -> dict:
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [rotary_dim // 2] (float32, CPU) and the cos/sin scaling, as transformers computes them.

    rotary_dim = int(head_dim * partial_rotary_factor). Static rope types (default, linear, llama3,
    yarn, ...) come from transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS.
    """
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type in _DYNAMIC:
        raise NotImplementedError(f"rope_type {rope_type!r} rescales with the sequence length and is "
                                  f"not supported; use a checkpoint with a static rope type")
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_type {rope_type!r} is unknown; known: default, "
                                  f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    with torch.device("cpu"):  # models are built under the meta device; these tables must be real
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float().cpu(), float(scaling)


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin) each [T, rotary_dim], float32; shared by a model's attention layers."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        # A plain attribute, not a buffer: models are built on the meta device, this stays real.
        self._inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        self.rotary_dim = 2 * self._inv_freq.numel()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = torch.outer(positions.float(), self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.scaling == 1.0:  # (most rope types: the multiply would change nothing)
            return emb.cos(), emb.sin()
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides) rotated on its first rotary_dim = cos.shape[-1] dims; the rest
    pass through. Returns a new [T, H, D] tensor: x1 * cos - x2 * sin | x2 * cos + x1 * sin."""
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    half = rot // 2
    x_rot = x if rot == x.shape[-1] else x[..., :rot]
    y = x_rot * cos
    y[..., :half].addcmul_(x_rot[..., half:], sin[..., :half], value=-1.0)
    y[..., half:].addcmul_(x_rot[..., :half], sin[..., half:])
    return y if rot == x.shape[-1] else torch.cat((y, x[..., rot:]), dim=-1)
