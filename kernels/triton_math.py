"""Small Triton device functions shared by the state kernels."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20), accurate for large negative x."""
    u = tl.exp(-tl.abs(x))
    # log1p(u) without a log1p intrinsic: the series where 1 + u would round away u
    log1p_u = tl.where(u < 1e-4, u - 0.5 * u * u, tl.log(1.0 + u))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_u)


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


def device_guard(t: torch.Tensor):
    """The CUDA device context of `t` for a launch, or nothing on CPU (TRITON_INTERPRET)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
