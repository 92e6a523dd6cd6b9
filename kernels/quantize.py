"""Quantized cache rows: encode values into codes and scales, decode them back. `layout` is a
hybridkv.cache_dtype.QuantLayout, not imported (kernels import nothing of the memory side).
CPU float32: one C pass each (kernels/native/quantize.c); everything else, and stochastic
rounding, the layout's torch path, which is the specification (tests/kernels/test_quantize.py
compares bytes on random inputs). Measured, 1 thread, loaded machine: a batch of 9 Mamba2 states of
16k values encodes in ~235 us in C against ~600 us through torch's elementwise passes, decodes in ~95
against ~165 us (BENCHMARKS.md, "Quantized caches").
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .native_args import I64, INT, CFunction, Ptr, f32

ENCODE = CFunction("quantize", "quant_encode_f32", None,
                   x=f32("items", "A * L * B"), raw=Ptr(torch.uint8, ("items", "nbytes")), items=I64, A=I64, L=I64,
                   B=I64, nbytes=I64, code_bytes=I64, fp8=INT)
DECODE = CFunction("quantize", "quant_decode_f32", None,
                   raw=Ptr(torch.uint8, ("items", "nbytes")), y=f32("items", "A * L * B", new=True), items=I64,
                   A=I64, L=I64, B=I64, nbytes=I64, code_bytes=I64, fp8_values=f32(256, optional=True))
_FP8_VALUES: Optional[torch.Tensor] = None


def _dims(layout) -> tuple[int, int, int]:
    """(A, L, B): the item as [A][L][B] with the rows along L."""
    s, d = layout.shape, layout.row_dim
    return math.prod(s[:d]), s[d], math.prod(s[d + 1:])


def _fp8_values() -> torch.Tensor:
    global _FP8_VALUES
    if _FP8_VALUES is None:
        _FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return _FP8_VALUES


def encode(layout, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """values [*lead, *shape] -> raw [*lead, nbytes] uint8 (QuantLayout.encode)."""
    if generator is not None or x.dtype is not torch.float32 or not x.is_cpu or not ENCODE.available():
        return layout.encode(x, generator)
    lead = x.shape[:x.dim() - len(layout.shape)]
    items = math.prod(lead)
    raw = torch.empty(items, layout.nbytes, dtype=torch.uint8)
    if items:
        A, L, B = _dims(layout)
        ENCODE.call(x=x.reshape(items, layout.numel).contiguous(), raw=raw, items=items, A=A, L=L, B=B,
                    nbytes=layout.nbytes, code_bytes=layout.code_bytes, fp8=int(layout.dtype == "fp8_e4m3"))
    return raw.view(*lead, layout.nbytes)


def decode(layout, raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw [*lead, nbytes] uint8 -> values [*lead, *shape] of `dtype` (QuantLayout.decode)."""
    if not raw.is_cpu or not DECODE.available():
        return layout.decode(raw, dtype)
    lead = raw.shape[:-1]
    items = math.prod(lead)
    if not items:
        return layout.decode(raw, dtype)
    A, L, B = _dims(layout)
    y = DECODE.call(raw=raw.reshape(items, layout.nbytes).contiguous(), items=items, A=A, L=L, B=B,
                    nbytes=layout.nbytes, code_bytes=layout.code_bytes,
                    fp8_values=_fp8_values() if layout.dtype == "fp8_e4m3" else None)
    return y.view(*lead, *layout.shape).to(dtype)
