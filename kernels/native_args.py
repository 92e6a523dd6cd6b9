"""What the C kernels' callers check before passing tensors as raw pointers (see native_cpu.py).

The C kernels take fp32 on the CPU, rows whose inner dims are contiguous (the row stride may be
anything: a column slice of a projection), and int32 slot ids. A tensor that fails a check makes
the caller run its torch path instead.
"""
from __future__ import annotations

import torch


def fp32_cpu(*ts) -> bool:
    """Every tensor given (None skipped) is float32 on the CPU."""
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in ts)


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer, or NULL for None (an optional argument)."""
    return None if t is None else t.data_ptr()


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
