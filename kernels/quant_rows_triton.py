"""Quantized cache rows in Triton: a row's scale and one-byte codes from float32 values, and values
from codes, the bytes hybridkv/cache_dtype.py's torch path writes (int8: scale = max|row| / 127,
codes rounded to nearest even and clamped; fp8_e4m3: scale = max|row| / 448, e4m3fn codes; a row
holding a NaN or an infinity gets a NaN scale, so it decodes to NaN). Device functions, shared by
the kernels that keep quantized caches in place (attention_decode_quantized_triton.py,
mamba2_quantized_triton.py).

Exact on the interpreter and compiled alike, which takes three choices:
- scale and 1 / scale by `tl.math.div_rn`: Triton's `/` on fp32 is an approximate division on
  NVIDIA GPUs, torch's is IEEE;
- round to nearest even with no addition to the product x / scale: a compiled kernel may fuse a
  multiply and its add into one fma (one rounding where torch rounds twice), so the product is only
  truncated and compared here (`round_half_even`);
- fp8 codes from the bits of |v| (round to nearest even at 3 mantissa bits; below 2^-6 in steps of
  2^-9, whose products are exact), not from a float8 conversion the interpreter and the GPU might
  round differently. fp8 codes decode through the 256-entry table of their values
  (quantize.fp8_values_table), int8 codes as signed bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import quantize

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # (a global a kernel reads must be a constexpr)
_FP8_VALUES: dict = {}  # device -> quantize.fp8_values_table() there


def fp8_values_on(device: torch.device) -> torch.Tensor:
    """The 256 float32 values of the e4m3fn codes (what decode_codes looks fp8 codes up in), on `device`."""
    got = _FP8_VALUES.get(device)
    if got is None:
        got = _FP8_VALUES[device] = quantize.fp8_values_table().to(device)
    return got


@triton.jit
def round_half_even(y):
    """fp32 y (|y| < 2**22, no NaN) -> the nearest integer, ties to even, int32."""
    t = y.to(tl.int32)  # toward zero
    tf = t.to(tl.float32)
    odd = (t & 1) == 1
    up = (y > tf + 0.5) | ((y == tf + 0.5) & odd)
    down = (y < tf - 0.5) | ((y == tf - 0.5) & odd)
    return t + up.to(tl.int32) - down.to(tl.int32)


@triton.jit
def row_amax(x, axis: tl.constexpr):
    """(max |x| over the finite values of each row along `axis`, whether the row holds a NaN or inf)."""
    a = tl.abs(x)
    finite = a <= FLT_MAX  # false for NaN and inf
    return tl.max(tl.where(finite, a, 0.0), axis), tl.max((~finite).to(tl.int32), axis) > 0


@triton.jit
def row_scale(amax, bad, TOP: tl.constexpr):
    """(scale, 1 / scale) of rows with max |x| `amax`: NaN and 0 where `bad`; 1 / scale is 0 for an
    all-zero row (codes 0), as QuantLayout.encode."""
    scale = tl.math.div_rn(amax, tl.full(amax.shape, TOP, tl.float32))
    ok = (scale > 0) & ~bad
    inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(ok, scale, 1.0))
    return tl.where(bad, float("nan"), scale), tl.where(ok, inv, 0.0)


@triton.jit
def _e4m3_code(v):
    """fp32 v (|v| <= 448, or NaN) -> its float8 e4m3fn byte (int32), round to nearest even."""
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(v)
    nan = a != a
    a = tl.where(nan, 0.0, a)
    sub = round_half_even(a * 512.0)  # below 2^-6: multiples of 2^-9 (a * 512 is exact)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960  # 3 mantissa bits kept, bias 127 -> 7
    code = tl.where(a < 0.015625, sub, tl.minimum(normal, 0x7E))
    return sign | tl.where(nan, 0x7F, code)


@triton.jit
def encode_codes(x, inv, FP8: tl.constexpr):
    """fp32 x and its rows' 1 / scale (broadcast to x) -> the codes, uint8 (int8 codes as bytes)."""
    y = x * inv
    if FP8:
        code = _e4m3_code(tl.minimum(tl.maximum(y, -448.0), 448.0))
    else:
        y = tl.where(y == y, tl.minimum(tl.maximum(y, -127.0), 127.0), 0.0)  # NaN: a bad row's
        code = round_half_even(y) & 0xFF
    return code.to(tl.uint8)


@triton.jit
def decode_codes(codes, scale, fp8_values_ptr, FP8: tl.constexpr):
    """uint8 codes and their rows' scale (broadcast to codes) -> fp32 values (code value x scale)."""
    if FP8:
        vals = tl.load(fp8_values_ptr + codes.to(tl.int32))
    else:
        vals = codes.to(tl.int8, bitcast=True).to(tl.float32)
    return vals * scale
