"""Quantized cache rows: encode values into codes and scales, decode them back. `layout` is a
hybridkv.cache_dtype.QuantLayout, not imported (kernels import nothing of the memory side).
CPU float32: one C pass each (kernels/native/quantize.c), also in place over a pool's items
(`decode_gather`, `encode_scatter`: the cache staging reads a step's slots and blocks and writes
them back with no gathered copy); everything else, and stochastic
rounding, the layout's torch path, which is the specification (tests/kernels/test_quantize.py
compares bytes on random inputs). Measured, 1 thread, loaded machine: a batch of 9 Mamba2 states of
16k values encodes in ~235 us in C against ~600 us through torch's elementwise passes, decodes in ~95
against ~165 us (BENCHMARKS.md, "Quantized caches").
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .native_args import I64, INT, CFunction, Ptr, f32, i64

ENCODE = CFunction("quantize", "quant_encode_f32", None,
                   x=f32("items", "A * L * B"), raw=Ptr(torch.uint8, ("items", "nbytes")), items=I64, A=I64, L=I64,
                   B=I64, nbytes=I64, code_bytes=I64, fp8=INT)
DECODE = CFunction("quantize", "quant_decode_f32", None,
                   raw=Ptr(torch.uint8, ("items", "nbytes")), y=f32("items", "A * L * B", new=True), items=I64,
                   A=I64, L=I64, B=I64, nbytes=I64, code_bytes=I64, fp8_values=f32(256, optional=True))
DECODE_GATHER = CFunction("quantize", "quant_decode_gather_f32", INT,
                          pool=Ptr(torch.uint8, ("pool_items", "nbytes")), pool_items=I64, src=i64("n"), n=I64,
                          group=I64, y=f32("n * group", "A * L * B"), A=I64, L=I64, B=I64, nbytes=I64,
                          code_bytes=I64, fp8_values=f32(256, optional=True))
ENCODE_SCATTER = CFunction("quantize", "quant_encode_scatter_f32", INT,
                           x=f32("x_items", "A * L * B"), x_items=I64, src=i64("n"),
                           pool=Ptr(torch.uint8, ("pool_items", "nbytes")), pool_items=I64, dst=i64("n"), n=I64,
                           group=I64, A=I64, L=I64, B=I64, nbytes=I64, code_bytes=I64, fp8=INT)
_FP8_VALUES: Optional[torch.Tensor] = None


_DIMS: dict = {}  # id(layout) -> (layout, dims): the layout kept, so its id is not reused


def layout_dims(layout) -> tuple[int, int, int]:
    """(A, L, B): the item as [A][L][B] with the rows along L (computed once per layout)."""
    got = _DIMS.get(id(layout))  # by identity: hashing the dataclass costs more than the call
    if got is None or got[0] is not layout:
        s, d = layout.shape, layout.row_dim
        got = _DIMS[id(layout)] = (layout, (math.prod(s[:d]), s[d], math.prod(s[d + 1:])))
    return got[1]


def is_quantized_pool(pool: torch.Tensor, layout, shape: tuple) -> bool:
    """pool [slots, nbytes] uint8 on the CPU, contiguous, of `layout`'s items of `shape` (int8 or fp8):
    what the C decode kernels that update quantized slots in place take."""
    return (pool.dtype == torch.uint8 and pool.is_cpu and pool.dim() == 2 and pool.is_contiguous()
            and pool.shape[1] == layout.nbytes and tuple(layout.shape) == tuple(shape)
            and layout.dtype in ("int8", "fp8_e4m3"))


def _long(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def fp8_values_table() -> torch.Tensor:
    """The float32 value of each of the 256 fp8 e4m3fn bytes (what the C decoders look codes up in)."""
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
        A, L, B = layout_dims(layout)
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
    A, L, B = layout_dims(layout)
    y = DECODE.call(raw=raw.reshape(items, layout.nbytes).contiguous(), items=items, A=A, L=L, B=B,
                    nbytes=layout.nbytes, code_bytes=layout.code_bytes,
                    fp8_values=fp8_values_table() if layout.dtype == "fp8_e4m3" else None)
    return y.view(*lead, *layout.shape).to(dtype)


def _run_items(first: torch.Tensor, group: int) -> torch.Tensor:
    """The item indices of the runs of `group` items starting at `first` [n], run after run."""
    return (first.reshape(-1, 1) + torch.arange(group, device=first.device)).reshape(-1)


def _items(layout, pool: torch.Tensor) -> Optional[torch.Tensor]:
    """pool [..., nbytes] as [items, nbytes] without a copy, or None when it is not contiguous."""
    return pool.view(-1, layout.nbytes) if pool.is_contiguous() and pool.shape[-1] == layout.nbytes else None


def decode_gather(layout, pool: torch.Tensor, src: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """Decode the runs of `group` consecutive items of `pool` ([..., nbytes] uint8, its items in
    order) starting at item `src` [n] (int64) into `out` (n * group items, contiguous; float32 for
    the C pass, another dtype is cast by the torch path), run after run, in place: out.view(n * group, *shape) = decode(pool's items). The pool is read in
    place (no gathered copy). IndexError when a run leaves the pool. Returns `out`."""
    items = _items(layout, pool)
    n = src.numel()
    if items is None or out.dtype is not torch.float32 or not out.is_contiguous() or not (
            pool.is_cpu and out.is_cpu and src.is_cpu and DECODE_GATHER.available()):
        if items is None:
            items = pool.reshape(-1, layout.nbytes)
        out.view(n * group, *layout.shape).copy_(layout.decode(items[_run_items(src.to(pool.device), group)]))
        return out
    if n:
        A, L, B = layout_dims(layout)
        rc = DECODE_GATHER.call(pool=items, pool_items=items.shape[0], src=_long(src), n=n,
                                group=group, y=out.view(n * group, layout.numel), A=A, L=L, B=B,
                                nbytes=layout.nbytes, code_bytes=layout.code_bytes,
                                fp8_values=fp8_values_table() if layout.dtype == "fp8_e4m3" else None)
        if rc:
            raise IndexError(f"decode_gather: a run of {group} items from {src.tolist()} leaves a pool of {items.shape[0]}")
    return out


def encode_scatter(layout, x: torch.Tensor, src: torch.Tensor, pool: torch.Tensor, dst: torch.Tensor, group: int,
                   generator: Optional[torch.Generator] = None) -> None:
    """Encode the runs of `group` consecutive items of x ([..., *shape] values, its items in order)
    starting at item `src` [n] into the items of `pool` ([..., nbytes] uint8, contiguous) starting
    at `dst` [n], in place: pool's items = encode(x's items), run after run (runs into the pool must
    not overlap: which one is kept is the C loop's order, not torch's). `generator`: stochastic int8 rounding (the torch path), drawn over the runs' values
    in order. IndexError when a run leaves x or the pool."""
    items = _items(layout, pool)
    if items is None:
        raise ValueError("encode_scatter: the pool must be contiguous, [..., nbytes]")
    n = src.numel()
    if not n:
        return
    xi = x.reshape(-1, layout.numel)
    if generator is not None or x.dtype is not torch.float32 or not (
            pool.is_cpu and x.is_cpu and src.is_cpu and dst.is_cpu and ENCODE_SCATTER.available()):
        rows = xi[_run_items(src.to(x.device), group)].reshape(n * group, *layout.shape)
        items[_run_items(dst.to(pool.device), group)] = layout.encode(rows, generator)
        return
    A, L, B = layout_dims(layout)
    rc = ENCODE_SCATTER.call(x=xi if xi.is_contiguous() else xi.contiguous(), x_items=xi.shape[0],
                             src=_long(src), pool=items, pool_items=items.shape[0],
                             dst=_long(dst), n=n, group=group, A=A, L=L, B=B,
                             nbytes=layout.nbytes, code_bytes=layout.code_bytes, fp8=int(layout.dtype == "fp8_e4m3"))
    if rc:
        raise IndexError(f"encode_scatter: a run of {group} items leaves x ({xi.shape[0]} items) or the pool "
                         f"({items.shape[0]})")
