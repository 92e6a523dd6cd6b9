"""A C kernel's parameters, declared once by name, and the one way to call it (see native_cpu.py).

`CFunction(library, symbol, restype, **params)` lists the C function's parameters in the C
prototype's order, each with its type: a ctypes scalar (`I64`, `F32`, `INT`) or a tensor (`Ptr`:
dtype, shape in terms of the size parameters, layout). It builds the one call: keyword-only (a
missing or unknown name is a TypeError), every tensor checked before the C loop runs, dtype and
device (TypeError), shape against the size parameters it is declared with and layout
(ValueError), and its address passed by the call, never by a caller. A tensor declared `new` is
an output the call allocates (contiguous, of its declared shape: right by construction, so not
checked) and returns; its stride parameters are then set by the call, not given.

How the arguments reach C: ctypes converts each argument of a function with `argtypes` into a new
object (~0.5 us each: a 13-argument call cost ~7 us, the norm row itself ~0.3 us). So each C
function gets a generated entry point `<symbol>__args(const struct <symbol>_args *)` (C code
compiled with the kernel's file, native_cpu.library's `extra`) that calls it with the struct's
fields; the call packs its arguments into that struct with one `struct.Struct.pack` (native
layout, as the C compiler lays the struct out: checked by `_Static_assert`s of its size and each
field's offset) and makes one ctypes call (`argtypes` [c_char_p], `restype` the C function's).
The C compiler checks the declaration against the kernel's prototype: the count of parameters,
each pointer's element type and every narrowing of a scalar are errors in the entry point (a
declaration that does not match fails to build, and the test of every binding fails). Packing
checks each scalar's type and range (a float for an int, an int past 64 bits: TypeError).
The call's code is generated from the declaration, as dataclasses generate `__init__`.

The kernels' callers decide beforehand whether the C path applies (fp32_cpu, rows_ok, ...; a
tensor that does not fit makes them run the torch path); these checks are for bugs.
"""
from __future__ import annotations

import ctypes
import struct
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import native_cpu

I64, F32, INT = ctypes.c_int64, ctypes.c_float, ctypes.c_int
# each scalar type: its struct code and C type; tensors: a pointer ("P") to their element type
_SCALARS = {I64: ("q", "int64_t"), F32: ("f", "float"), INT: ("i", "int")}
_PACK_ERRORS = struct.error  # a value its C type cannot hold (a float past float32 packs as inf, as in C)
_ELEMENTS = {torch.float32: "float", torch.int32: "int32_t", torch.int64: "int64_t", torch.bool: "uint8_t",
             torch.uint8: "uint8_t"}


@dataclass(frozen=True)
class Ptr:
    """A tensor parameter: dtype, shape (ints or Python expressions of the size parameters, e.g.
    "nb", "H * P"; a name no parameter gives is the size of the first tensor that has it, and the
    others must agree), strides (None: contiguous; else one entry per dim like the shape, a row stride
    being the name of its size parameter), optional (None passes NULL), new (an output the call
    allocates and returns; a stride entry naming a parameter sets that parameter)."""

    dtype: torch.dtype
    shape: tuple
    strides: tuple | None = None
    optional: bool = False
    new: bool = False


def f32(*shape, strides=None, optional=False, new=False) -> Ptr:
    return Ptr(torch.float32, shape, strides, optional, new)


def i32(*shape) -> Ptr:
    return Ptr(torch.int32, shape)


def i64(*shape) -> Ptr:
    return Ptr(torch.int64, shape)


def flags(*shape) -> Ptr:
    """`const uint8_t *` flags, one byte each: a bool tensor."""
    return Ptr(torch.bool, shape)


class CFunction:
    """One C function of kernels/native/<library>.c, declared by name; call `.call(**arguments)`.

    `call` returns the C function's result, or with `new` outputs (result, *outputs), or for a
    void function the outputs alone (one: the tensor). `available()`: whether it can run here
    (native kernels on and built). `call` raises RuntimeError when it cannot, and TypeError or
    ValueError naming an argument that is wrong.
    """

    def __init__(self, library: str, symbol: str, restype, **params):
        self.library, self.symbol, self.restype, self.params = library, symbol, restype, params
        self._fn = None
        codes = "".join("P" if isinstance(p, Ptr) else _SCALARS[p][0] for p in params.values())
        self.packer = struct.Struct("@" + codes + "0q")  # native layout, padded to 8 like the C struct
        self.entry = f"{symbol}__args"
        self.source = _entry_point(self)
        self.argtypes = [ctypes.c_char_p]
        self.call = _generate(self, params)

    def function(self):
        """The loaded ctypes entry point (argtypes [c_char_p], the C function's restype), or None
        when native kernels are off or cannot be built here."""
        if not native_cpu.enabled():
            return None
        if self._fn is None:
            self._fn = native_cpu.function(self.library, self.entry, self.argtypes, self.restype,
                                           extra=self.source) or False
        return self._fn or None

    def available(self) -> bool:
        return native_cpu.enabled() and bool(self._fn or self.function())

    @contextmanager
    def replaced(self, fn):
        """Within the block, calls go to `fn` (this function's entry point from another build of the
        kernel: `native_cpu.library(library, source_dir, extra=self.source)[self.entry]`, argtypes
        and restype set) or, for None, the function is not available (benchmarks)."""
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


def _entry_point(cf: CFunction) -> str:
    """C code: the struct of cf's arguments (its layout asserted against cf.packer's) and
    `<symbol>__args`, which calls the kernel with its fields."""
    tag = f"{cf.symbol}_args"
    fields, asserts, prefix = [], [], "@"
    for name, p in cf.params.items():
        code = "P" if isinstance(p, Ptr) else _SCALARS[p][0]
        ctype = f"{_ELEMENTS[p.dtype]} *" if isinstance(p, Ptr) else _SCALARS[p][1] + " "
        fields.append(f"    {ctype}{name};")
        asserts.append(f"_Static_assert(offsetof(struct {tag}, {name}) == {struct.calcsize(prefix + '0' + code)}, "
                       f'"{name}");')
        prefix += code
    ret = {None: "void", I64: "int64_t", INT: "int", F32: "float"}[cf.restype]
    call = f"{cf.symbol}({', '.join(f'a->{n}' for n in cf.params)})"
    return "\n".join([
        "#include <stddef.h>", f"struct {tag} {{", *fields, "};",
        f'_Static_assert(sizeof(struct {tag}) == {cf.packer.size}, "size");', *asserts,
        "#pragma GCC diagnostic push",  # the declaration must match the prototype: no silent conversion
        '#pragma GCC diagnostic error "-Wconversion"',
        '#pragma GCC diagnostic error "-Wincompatible-pointer-types"',
        '#pragma GCC diagnostic error "-Wint-conversion"',
        f"{ret} {cf.entry}(const struct {tag} *a) {{ {'' if cf.restype is None else 'return '}{call}; }}",
        "#pragma GCC diagnostic pop", ""])


def _generate(cf: CFunction, params: dict):
    """The keyword-only call of `cf`: checks each tensor, allocates the outputs, packs, calls."""
    names = list(params)
    derived = {}  # a stride parameter of a new output -> that output's stride expression
    for name, p in params.items():
        if isinstance(p, Ptr) and p.new:
            if p.optional:
                raise ValueError(f"{cf.symbol}: output {name} cannot be optional")
            for i, s in enumerate(p.strides or ()):
                if isinstance(s, str) and s in params and not isinstance(params[s], Ptr):
                    derived[s] = f"{name}.stride({i})"
    given = [n for n in names if n not in derived and not (isinstance(params[n], Ptr) and params[n].new)]
    lines, allocs, args, bound = [], [], [], set(names)
    for name, p in params.items():
        if not isinstance(p, Ptr):
            args.append(name)
            continue
        args.append(f"0 if {name} is None else {name}.data_ptr()" if p.optional else f"{name}.data_ptr()")
        if p.new:  # contiguous, its declared shape: nothing to check
            allocs.append(f"    {name} = _empty({''.join(f'{d}, ' for d in p.shape)}dtype=_{name}_dtype)")  # (sizes as
            # separate arguments: torch parses them faster than a tuple)
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
        else:
            lines.append(f"        if not ({check}): {fail}")
    outs = [n for n in names if isinstance(params[n], Ptr) and params[n].new]
    result = "_r" if not outs else (
        f"_r, {', '.join(outs)}" if cf.restype is not None else ", ".join(outs) + ("," if len(outs) > 1 else ""))
    src = (f"def {cf.symbol}(*, {', '.join(given)}):\n    try:\n" + "\n".join(lines or ["        pass"]) + "\n"
           "    except AttributeError as e:\n"
           f"        raise TypeError(f'{cf.symbol}: a tensor argument is not a tensor ({{e}})') from None\n"
           + "".join(a + "\n" for a in allocs)
           + "".join(f"    {n} = {e}\n" for n, e in derived.items())
           + "    try:\n"
           f"        _a = _pack({', '.join(args)})\n"
           "    except _pack_errors:\n"
           "        _bad_scalar(_cf, locals())\n"
           "    _r = (_cf._fn or _cf._loaded())(_a)\n"
           f"    return {result}\n")
    scope = {"_bad": _bad, "_bad_scalar": _bad_scalar, "_same_layout": _same_layout, "_cf": cf,
             "_pack": cf.packer.pack, "_pack_errors": _PACK_ERRORS, "_empty": torch.empty}
    scope.update({f"_{n}_dtype": p.dtype for n, p in params.items() if isinstance(p, Ptr)})
    exec(compile(src, f"<CFunction {cf.library}.{cf.symbol}>", "exec"), scope)
    fn = scope[cf.symbol]
    fn.__doc__ = f"{cf.symbol}(*, {', '.join(given)}) -> {result.replace('_r', 'result').rstrip(',')}; see {cf.library}.c"
    cf.call_source = src  # (to read what a call does)
    return fn


def _bad_scalar(cf: CFunction, values: dict) -> None:
    """Raises the TypeError naming the first scalar argument that does not fit its C type."""
    for name, p in cf.params.items():
        if isinstance(p, Ptr):
            continue
        code, ctype = _SCALARS[p]
        try:
            struct.pack("@" + code, values[name])
        except _PACK_ERRORS as e:
            raise TypeError(f"{cf.symbol}: argument {name}: expected a C {ctype}, got {values[name]!r} ({e})") \
                from None
    raise TypeError(f"{cf.symbol}: an argument does not fit its C type")


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
