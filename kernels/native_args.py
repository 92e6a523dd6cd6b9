"""A C kernel's parameters, declared once by name, and the one way to call it (see native_cpu.py).

`CFunction(library, symbol, restype, **params)` lists the C function's parameters in the C
prototype's order, each with its type: a ctypes scalar (`I64`, `F32`, `INT`) or a tensor (`Ptr`:
dtype, shape in terms of the size parameters, layout). It sets the function's ctypes `argtypes`
and `restype`, and builds the one call: keyword-only (a missing or unknown name is a TypeError),
every tensor checked before the C loop runs, dtype and device (TypeError), shape against the
size parameters it is declared with and layout (ValueError), and its address passed by the call,
never by a caller. The call's code is generated from the declaration, as dataclasses generate
`__init__`, so a named, checked call costs about what a positional one did (an RMSNorm row at
batch 1 runs in a few microseconds: a loop over the parameters per call would cost more than it).

The kernels' callers decide beforehand whether the C path applies (fp32_cpu, rows_ok, ...; a
tensor that does not fit makes them run the torch path); these checks are for bugs.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import native_cpu

I64, F32, INT = ctypes.c_int64, ctypes.c_float, ctypes.c_int


@dataclass(frozen=True)
class Ptr:
    """A tensor parameter: dtype, shape (ints or Python expressions of the size parameters, e.g.
    "nb", "H * P"; a name no parameter gives is the size of the first tensor that has it, and the
    others must agree), strides (None: contiguous; else one entry per dim like the shape, a row stride
    being the name of its size parameter), optional (None passes NULL)."""

    dtype: torch.dtype
    shape: tuple
    strides: tuple | None = None
    optional: bool = False


def f32(*shape, strides=None, optional=False) -> Ptr:
    return Ptr(torch.float32, shape, strides, optional)


def i32(*shape) -> Ptr:
    return Ptr(torch.int32, shape)


def i64(*shape) -> Ptr:
    return Ptr(torch.int64, shape)


def flags(*shape) -> Ptr:
    """`const uint8_t *` flags, one byte each: a bool tensor."""
    return Ptr(torch.bool, shape)


class CFunction:
    """One C function of kernels/native/<library>.c, declared by name; call `.call(**arguments)`.

    `available()`: whether it can run here (native kernels on and built). `call` raises
    RuntimeError when it cannot, and TypeError or ValueError naming an argument that is wrong.
    """

    def __init__(self, library: str, symbol: str, restype, **params):
        self.library, self.symbol, self.restype, self.params = library, symbol, restype, params
        self._fn = None
        self.argtypes = [ctypes.c_void_p if isinstance(p, Ptr) else p for p in params.values()]
        self.call = _generate(self, params)

    def function(self):
        """The loaded ctypes function (argtypes and restype set), or None when native kernels are
        off or cannot be built here."""
        if not native_cpu.enabled():
            return None
        if self._fn is None:
            self._fn = native_cpu.function(self.library, self.symbol, self.argtypes, self.restype) or False
        return self._fn or None

    def available(self) -> bool:
        return native_cpu.enabled() and bool(self._fn or self.function())

    @contextmanager
    def replaced(self, fn):
        """Within the block, calls go to `fn` (a ctypes function of this prototype, argtypes set:
        another build of the kernel) or, for None, the function is not available (benchmarks)."""
        before, self._fn = self._fn, (False if fn is None else fn)
        try:
            yield
        finally:
            self._fn = before

    def _loaded(self):
        fn = self.function()
        if fn is None:
            raise RuntimeError(f"{self.symbol}: native kernels are off or not built here; "
                               "check available() and run the torch path")
        return fn


def _generate(cf: CFunction, params: dict):
    """The keyword-only call of `cf`: checks each tensor, then one positional ctypes call."""
    names = list(params)
    lines, args, bound = [], [], set(names)
    for name, p in params.items():
        if not isinstance(p, Ptr):
            args.append(name)
            continue
        for i, d in enumerate(p.shape):  # a size no parameter gives: taken from the first tensor with it
            if isinstance(d, str) and d.isidentifier() and d not in bound:
                if p.optional:
                    raise ValueError(f"{cf.symbol}: size {d} first appears on optional {name}")
                bound.add(d)
                lines.append(f"        {d} = {name}.shape[{i}] if {name}.dim() == {len(p.shape)} else -1")
        shape = "(" + "".join(f"{d}, " for d in p.shape) + ")"
        if p.strides is None:
            layout = f"{name}.is_contiguous()"
            want = "None"
        else:
            want = "(" + "".join(f"{s}, " for s in p.strides) + ")"
            layout = f"({name}.stride() == {want} or _same_layout({name}, {want}))"
        # a non-tensor fails at .dtype (AttributeError, caught below)
        check = f"{name}.dtype is _{name}_dtype and {name}.is_cpu and {name}.shape == {shape} and {layout}"
        fail = f"_bad({cf.symbol!r}, {name!r}, {name}, _{name}_dtype, {shape}, {want})"
        if p.optional:
            lines.append(f"        if {name} is not None and not ({check}): {fail}")
            args.append(f"None if {name} is None else {name}.data_ptr()")
        else:
            lines.append(f"        if not ({check}): {fail}")
            args.append(f"{name}.data_ptr()")
    src = (f"def {cf.symbol}(*, {', '.join(names)}):\n    try:\n" + "\n".join(lines) + "\n"
           "    except AttributeError as e:\n"
           f"        raise TypeError(f'{cf.symbol}: a tensor argument is not a tensor ({{e}})') from None\n"
           f"    return (_cf._fn or _cf._loaded())({', '.join(args)})\n")
    scope = {"_bad": _bad, "_same_layout": _same_layout, "_cf": cf}
    scope.update({f"_{n}_dtype": p.dtype for n, p in params.items() if isinstance(p, Ptr)})
    exec(compile(src, f"<CFunction {cf.library}.{cf.symbol}>", "exec"), scope)
    return scope[cf.symbol]


def _same_layout(t: torch.Tensor, strides: tuple) -> bool:
    """t's strides are `strides` wherever its size is not 1 (a size-1 dim's stride is never used)."""
    return all(n == 1 or s == w for n, s, w in zip(t.shape, t.stride(), strides))


def _bad(symbol: str, name: str, t, dtype: torch.dtype, shape: tuple, strides) -> None:
    """Raises the error that says what is wrong with argument `name` of `symbol`."""
    where = f"{symbol}: argument {name}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a {dtype} tensor, got {type(t).__name__}")
    if t.dtype != dtype or not t.is_cpu:
        raise TypeError(f"{where}: expected {dtype} on the CPU, got {t.dtype} on {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{where}: expected shape {shape}, got {tuple(t.shape)}")
    raise ValueError(f"{where}: expected {'a contiguous tensor' if strides is None else f'strides {strides}'}"
                     f", got strides {t.stride()}")


def fp32_cpu(*ts) -> bool:
    """Every tensor given (None skipped) is float32 on the CPU."""
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in ts)


def rows_ok(t: torch.Tensor, inner: tuple[int, ...]) -> bool:
    """t is [n, *inner] with everything but the row stride contiguous."""
    if tuple(t.shape[1:]) != inner:
        return False
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def as_rows(t: torch.Tensor, inner: tuple[int, ...]) -> torch.Tensor:
    """t itself when rows_ok, else a contiguous copy (its shape must already be [n, *inner])."""
    return t if rows_ok(t, inner) else t.contiguous()


def slots_int32(slot_idx: torch.Tensor) -> torch.Tensor:
    """slot_idx as a contiguous int32 tensor (no copy when it already is one)."""
    return slot_idx if slot_idx.dtype == torch.int32 and slot_idx.is_contiguous() else \
        slot_idx.to(torch.int32).contiguous()


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer, or NULL for None: only for the fields of a ctypes.Structure, which its
    builder checks (Mamba2MixerDecode); function arguments go through CFunction."""
    return None if t is None else t.data_ptr()
