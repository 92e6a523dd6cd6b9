"""RMSNorm rows: native C on CPU in float32 (kernels/native/rms_norm.c), torch everywhere else.

A norm row of a few hundred elements costs torch ~40 us of dispatch (rms_norm is a composite of
several ops, each with its own pass), the C loop ~3 us including the ctypes call; a pre-norm
block's residual add rides along in the same pass (`add_rms_norm`). Any other dtype or device,
a tensor that needs autograd, or native kernels off (HYBRIDKV_CPU_NATIVE=0, native_cpu.forced_off(),
no compiler) takes the torch path, which is the specification (models/norms.py's formulas).
Checked against it on random inputs in tests/kernels/test_rms_norm.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import native_cpu
from .native_args import F32, I64, INT, CFunction, f32

# native/rms_norm.c, declared parameter by parameter (native_args.py): x [n, d] rows, w [d]
# (outputs `new`: allocated by the call, returned)
RMS_NORM = CFunction("rms_norm", "rms_norm_f32", None,
                     x=f32("n", "d", strides=("x_stride", 1)), x_stride=I64, w=f32("d"), plus_one=INT,
                     out=f32("n", "d", strides=("out_stride", 1), new=True), out_stride=I64, n=I64, d=I64,
                     eps=F32)
ADD_RMS_NORM = CFunction("rms_norm", "add_rms_norm_f32", None,
                         h=f32("n", "d", strides=("h_stride", 1)), h_stride=I64,
                         delta=f32("n", "d", strides=("delta_stride", 1)), delta_stride=I64,
                         w=f32("d"), plus_one=INT, sum=f32("n", "d", strides=("sum_stride", 1), new=True),
                         sum_stride=I64, out=f32("n", "d", strides=("out_stride", 1), new=True), out_stride=I64,
                         n=I64, d=I64, eps=F32)
GATED_RMS_NORM = CFunction("rms_norm", "gated_rms_norm_f32", None,
                           y=f32("n", "d", strides=("y_stride", 1)), y_stride=I64,
                           z=f32("n", "d", strides=("z_stride", 1), optional=True), z_stride=I64,
                           w=f32("d"), out=f32("n", "d", strides=("out_stride", 1), new=True), out_stride=I64,
                           n=I64, d=I64, group=I64, norm_before_gate=INT, eps=F32)
# gated norm: C up to this many elements (measured, 1 thread, rows of 512: 32 rows 139 vs 197 us,
# 256 rows 859 vs 1482 us, 2048 rows 6707 vs 5925 us in torch)
_GATED_C_MAX_ELEMENTS = 512 * 512
_F32 = torch.float32


def _rows(*ts: Optional[torch.Tensor]) -> bool:
    """Every tensor a CPU float32 matrix of rows with contiguous elements, outside autograd."""
    for t in ts:
        if t is None:
            continue
        if not _row_matrix(t):
            return False
    return True


def _row_matrix(t: torch.Tensor) -> bool:
    # one expression: a decode step's norms ask it ~17 times a step (a loop over *ts costs ~2x)
    return t.dtype is _F32 and t.is_cpu and t.dim() == 2 and t.stride(1) == 1 and not t.requires_grad


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] as a [n, d] view when that needs no copy (else x itself, refused by _rows)."""
    if x.dim() == 2:
        return x
    if x.dim() > 2 and x.is_contiguous():
        return x.view(-1, x.shape[-1])
    return x


def _weight_ok(w: torch.Tensor, d: int) -> bool:
    return (w.dtype is _F32 and w.is_cpu and w.shape == (d,) and w.is_contiguous()
            and not (w.requires_grad and torch.is_grad_enabled()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    """x [..., d], weight [d], both float32 -> (x * rsqrt(mean(x^2) + eps)) * w, w = weight (or
    1 + weight when plus_one), a new tensor."""
    x2 = _as_rows(x)
    if not (_row_matrix(x2) and _weight_ok(weight, x.shape[-1]) and RMS_NORM.available()):
        if plus_one:
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + weight)
        return F.rms_norm(x, weight.shape, weight, eps)
    n, d = x2.shape
    out = RMS_NORM.call(x=x2, x_stride=x2.stride(0), w=weight, plus_one=plus_one, n=n, d=d, eps=eps)
    return out if x2 is x else out.view(x.shape)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [T, d] float32 -> (s = h + delta, rms_norm(s) * w) as new tensors; the
    pre-norm block's residual add and the next norm in one pass."""
    if not (h.shape == delta.shape and _row_matrix(h) and _row_matrix(delta) and _weight_ok(weight, h.shape[1])
            and ADD_RMS_NORM.available()):
        s = h + delta
        return s, rms_norm(s, weight, eps, plus_one)
    n, d = h.shape
    return ADD_RMS_NORM.call(h=h, h_stride=h.stride(0), delta=delta, delta_stride=delta.stride(0), w=weight,
                             plus_one=plus_one, n=n, d=d, eps=eps)


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
    if not GATED_RMS_NORM.available():
        return None
    n, d = y2.shape
    out = GATED_RMS_NORM.call(y=y2, y_stride=y2.stride(0), z=z2, z_stride=0 if z2 is None else z2.stride(0),
                              w=weight, n=n, d=d, group=group_size, norm_before_gate=norm_before_gate, eps=eps)
    return out if y2 is y else out.view(y.shape)

