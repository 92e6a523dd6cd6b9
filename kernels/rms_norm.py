"""RMSNorm rows: native C on CPU in float32 (kernels/native/rms_norm.c), torch everywhere else.

A norm row of a few hundred elements costs torch ~40 us of dispatch (rms_norm is a composite of
several ops, each with its own pass), the C loop ~3 us including the ctypes call; a pre-norm
block's residual add rides along in the same pass (`add_rms_norm`). Any other dtype or device,
a tensor that needs autograd, or native kernels off (HYBRIDKV_CPU_NATIVE=0, native_cpu.forced_off(),
no compiler) takes the torch path, which is the specification (models/norms.py's formulas).
Checked against it on random inputs in tests/kernels/test_rms_norm.py.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F

from . import native_cpu

_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_norm_f32": [_P, _I, _P, _B, _P, _I, _I, _I, _F],
    "add_rms_norm_f32": [_P, _I, _P, _I, _P, _B, _P, _I, _P, _I, _I, _I, _F],
    "gated_rms_norm_f32": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _B, _F],
}
_functions: dict = {}
# gated norm: C up to this many elements (measured, 1 thread, rows of 512: 32 rows 139 vs 197 us,
# 256 rows 859 vs 1482 us, 2048 rows 6707 vs 5925 us in torch)
_GATED_C_MAX_ELEMENTS = 512 * 512


def _native(symbol: str):
    """The C function, or None when native kernels are off or unbuilt (looked up once)."""
    if not native_cpu.enabled():
        return None
    fn = _functions.get(symbol, False)
    if fn is False:
        fn = _functions[symbol] = native_cpu.function("rms_norm", symbol, _SIGNATURES[symbol])
    return fn


def _rows(*ts: Optional[torch.Tensor]) -> bool:
    """Every tensor a CPU float32 matrix of rows with contiguous elements, outside autograd."""
    for t in ts:
        if t is None:
            continue
        if t.dtype != torch.float32 or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1 \
                or t.requires_grad:
            return False
    return True


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] as a [n, d] view when that needs no copy (else x itself, refused by _rows)."""
    if x.dim() == 2:
        return x
    if x.dim() > 2 and x.is_contiguous():
        return x.view(-1, x.shape[-1])
    return x


def _weight_ok(w: torch.Tensor, d: int) -> bool:
    return (w.dtype == torch.float32 and w.is_cpu and w.is_contiguous()
            and w.numel() == d and not (w.requires_grad and torch.is_grad_enabled()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    """x [..., d], weight [d], both float32 -> (x * rsqrt(mean(x^2) + eps)) * w, w = weight (or
    1 + weight when plus_one), a new tensor."""
    x2 = _as_rows(x)
    fn = _native("rms_norm_f32") if _rows(x2) and _weight_ok(weight, x.shape[-1]) else None
    if fn is None:
        if plus_one:
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + weight)
        return F.rms_norm(x, weight.shape, weight, eps)
    out = torch.empty_like(x)  # (contiguous: x's rows have contiguous elements)
    n, d = x2.shape
    fn(x2.data_ptr(), x2.stride(0), weight.data_ptr(), plus_one, out.data_ptr(), d, n, d, eps)
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [T, d] float32 -> (s = h + delta, rms_norm(s) * w) as new tensors; the
    pre-norm block's residual add and the next norm in one pass."""
    fn = None
    if h.shape == delta.shape and _rows(h, delta) and _weight_ok(weight, h.shape[-1]):
        fn = _native("add_rms_norm_f32")
    if fn is None:
        s = h + delta
        return s, rms_norm(s, weight, eps, plus_one)
    n, d = h.shape
    s, out = torch.empty_like(h), torch.empty_like(h)  # (contiguous, as in rms_norm)
    fn(h.data_ptr(), h.stride(0), delta.data_ptr(), delta.stride(0), weight.data_ptr(), plus_one,
       s.data_ptr(), d, out.data_ptr(), d, n, d, eps)
    return s, out


def gated_rms_norm(y: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                   group_size: int, norm_before_gate: bool) -> Optional[torch.Tensor]:
    """y, z [..., d] float32 (z None: no gate), groups of group_size -> [..., d] by the C loop, or
    None when it does not apply (the caller runs the torch formula, GatedRMSNorm.forward)."""
    y2 = _as_rows(y)
    z2 = None if z is None else _as_rows(z)
    if z2 is not None and z2.shape != y2.shape:
        return None
    if not (_rows(y2, z2) and _weight_ok(weight, y.shape[-1]) and y.shape[-1] % group_size == 0):
        return None
    if z2 is not None and y2.numel() > _GATED_C_MAX_ELEMENTS:
        return None  # the C loop's scalar expf loses to torch's vectorised silu on prefill-sized inputs
    fn = _native("gated_rms_norm_f32")
    if fn is None:
        return None
    n, d = y2.shape
    out = torch.empty_like(y)  # (contiguous, as in rms_norm)
    fn(y2.data_ptr(), y2.stride(0), None if z2 is None else z2.data_ptr(),
       0 if z2 is None else z2.stride(0), weight.data_ptr(), out.data_ptr(), d, n, d, group_size,
       norm_before_gate, eps)
    return out
