"""RMS norms: plain, zero-centered (1 + w, Qwen3-Next), and gated with groups (Mamba2 / GDN outputs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops


class RMSNorm(nn.Module):
    """x [..., dim] -> x / rms(x) * w (or * (1 + w) when zero_centered), computed in float32.

    Llama-style casts back before the weight multiply; the zero-centered (Qwen3-Next) form
    multiplies in float32 and casts after, as each reference does.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == dtype:
            # float32: both forms below are one formula; a C loop on CPU, else torch's rms_norm
            return ops.rms_norm(x, self.weight, self.eps, self.zero_centered)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h, delta [T, dim] -> (h + delta, this norm of it): a pre-norm block's residual add
        and the next norm, in one pass over the row in float32 on CPU."""
        if h.dtype == torch.float32 and self.weight.dtype == torch.float32 \
                and type(self).forward is RMSNorm.forward and "forward" not in self.__dict__:
            return ops.add_rms_norm(h, delta, self.weight, self.eps, self.zero_centered)
        # a subclass's (or a patched) forward has its own formula: add, then call it
        s = h + delta
        return s, self(s)


class GatedRMSNorm(nn.Module):
    """y [..., dim], gate z [..., dim] -> RMS-normalised over groups of `group_size`, gated by silu(z).

    norm_before_gate=False (Mamba2 / Bamba): norm(y * silu(z)) * w.
    norm_before_gate=True (Qwen3-Next GDN): norm(y) * w * silu(z).
    """

    def __init__(self, dim: int, group_size: int | None = None, eps: float = 1e-6,
                 norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size or dim
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        *prefix, dim = h.shape
        g = h.view(*prefix, dim // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.view(*prefix, dim)

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        dtype = y.dtype
        if dtype == torch.float32 and self.weight.dtype == dtype:
            out = ops.gated_rms_norm(y, z, self.weight, self.eps, self.group_size, self.norm_before_gate)
            if out is not None:  # the C loop (CPU, float32, rows it can read); else the formulas below
                return out
        h = y.float()
        if self.norm_before_gate:
            h = self.weight * self._norm(h).to(dtype)
            if z is not None:
                h = h * F.silu(z.float())
            return h.to(dtype)
        if z is not None:
            h = h * F.silu(z.float())
        return self.weight * self._norm(h).to(dtype)
