"""Small Triton device functions shared by the kernels."""
from __future__ import annotations

import contextlib
import os

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


@triton.jit
def fold_sink(m_i, l_i, acc, sink):
    """An attention sink's logit (log2 units, -inf for none) joined to an online softmax's running
    max m_i, denominator l_i and accumulator acc (rows x d), with no value: (m_i, l_i, acc)."""
    m_fin = tl.maximum(m_i, sink)
    m_safe = tl.where(m_fin > float("-inf"), m_fin, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    return m_fin, l_i * alpha + tl.exp2(sink - m_safe), acc * alpha[:, None]


@triton.jit
def tanh(x):
    """tanh by exp (tl.math has no portable tanh across Triton versions): exact, overflow-free."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


def device_guard(t: torch.Tensor):
    """The CUDA device context of `t` for a launch, or nothing on CPU (TRITON_INTERPRET)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def interpreted() -> bool:
    """True when kernels run in Triton's interpreter (TRITON_INTERPRET=1). Loops then run as
    `while` loops: Triton 3.6's interpreter takes no tensor, not even a scalar kernel argument, as
    a range() bound. Decided by the mode, not by the tensors' device, so a compile-only run on CPU
    tensors (sm90_compile) still compiles the `for` loops a GPU runs."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
