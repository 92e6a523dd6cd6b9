"""How an op's call reaches its implementation (the registry's internals; ops.py declares the ops).

`declare` makes each op an `Op` whose call takes the op's own parameters, written out from its
signature once (as dataclasses writes an `__init__`), and hands them on unchanged to the backend's
implementation: no `*args, **kwargs` packed and unpacked per call (~1 us with keywords, a few us
with the Mamba2 decode's seventeen). The backend: 'triton' (the CUDA implementation) for inputs
on CUDA, 'torch' (the CPU implementation: torch and the native C kernels) elsewhere;
HYBRIDKV_BACKEND=torch|triton overrides (read at each call: tests and the decode-graph dry run set
it), and an op given the step's `plan_cache` looks the backend up once per step.
"""
from __future__ import annotations

import ast
import importlib
import os
import sys
from typing import Optional

import torch

_VALID = ("torch", "triton")


def backend_for(t: torch.Tensor) -> str:
    """'triton' or 'torch' for a kernel whose inputs live where `t` lives."""
    forced = os.environ.get("HYBRIDKV_BACKEND", "").strip().lower()
    if forced:
        if forced not in _VALID:
            raise ValueError(f"HYBRIDKV_BACKEND={forced!r}; expected one of {_VALID}")
        return forced
    return "triton" if t.is_cuda else "torch"


class Op:
    """One op: `signature` ("name(params)", as a def writes them), cpu and cuda ("module:function"
    of hybridkv.kernels taking exactly those parameters, or None: the op returns None on that
    backend). Made by `declare`, which gives each op the call of its signature."""

    def __init__(self, signature: str, cpu: Optional[str], cuda: Optional[str], doc: str):
        self.name = signature[:signature.index("(")]
        self.signature, self.cpu, self.cuda, self.__doc__ = signature, cpu, cuda, doc
        self._where = {"torch": _split(cpu), "triton": _split(cuda)}
        self._one = cpu == cuda  # one function on both backends (the norms): nothing to choose

    def backend(self, t, plan_cache: Optional[dict] = None) -> str:
        """'torch' (the CPU implementation) or 'triton' (the CUDA one) for inputs on t's device."""
        if plan_cache is None:
            return backend_for(t)
        backend = plan_cache.get("backend")
        if backend is None:
            backend = plan_cache["backend"] = backend_for(t)
        return backend

    def impl(self, backend: str):
        """The implementation this backend runs, or None."""
        where = self._where[backend]
        return None if where is None else _function(where)

    def __repr__(self) -> str:
        return f"Op({self.signature}: cpu {self.cpu}, cuda {self.cuda})"


# An op's call, written for its parameters: the backend's implementation gets the arguments as given
_CALL = """
def __call__(self, {params}):
    where = self._where["torch" if self._one else self.backend({first}, {plan_cache})]
    return None if where is None else _function(where)({arguments})
"""


def declare(signature: str, cpu: Optional[str], cuda: Optional[str], doc: str) -> Op:
    """The op `signature` names: an instance of its own Op subclass whose __call__ takes the
    signature's parameters (defaults included) and passes positional ones on by position,
    keyword-only ones by name. The backend is chosen by the first parameter's device."""
    name = signature[:signature.index("(")]
    args = ast.parse(f"def {signature}: pass").body[0].args
    if args.vararg or args.kwarg or args.posonlyargs:
        raise ValueError(f"op {name}: declare its parameters by name (no *args, **kwargs or positional-only)")
    positional, keywords = [a.arg for a in args.args], [a.arg for a in args.kwonlyargs]
    source = _CALL.format(
        params=signature[signature.index("(") + 1:signature.rindex(")")], first=positional[0],
        plan_cache="plan_cache" if "plan_cache" in positional + keywords else "None",
        arguments=", ".join(positional + [f"{k}={k}" for k in keywords]))
    namespace = {"_function": _function}
    exec(compile(source, f"<op {name}>", "exec"), namespace)
    return type(f"Op_{name}", (Op,), {"__call__": namespace["__call__"]})(signature, cpu, cuda, doc)


def _split(where: Optional[str]) -> Optional[tuple[str, str]]:
    if where is None:
        return None
    module, fn = where.split(":")
    return f"{__package__}.{module}", fn


def _function(where: tuple[str, str]):
    """The function `where` ("hybridkv.kernels.<module>", name) names now; its module imports at first use."""
    module, fn = where
    return getattr(sys.modules.get(module) or importlib.import_module(module), fn)
