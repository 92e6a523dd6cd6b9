"""Which backend an op runs (the registry's internals, ops.py): 'triton' (its CUDA implementation)
for inputs on CUDA, 'torch' (its CPU implementation: torch and the native C kernels) elsewhere;
HYBRIDKV_BACKEND=torch|triton overrides (read at each call: tests and the decode-graph dry run set it)."""
from __future__ import annotations

import os

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
