"""Catch the ops that make the host wait for the device, so a step can be proven capturable.

A CUDA graph replays device work only: any op whose result the host must read (a `.item()`, a
`.tolist()`, a shape that depends on data) either breaks the capture or freezes one step's value
into every replay. `NoHostSync` is a TorchDispatchMode that raises `HostSyncError` at the first
such op, naming it, so the check runs on CPU tensors as well as on a GPU: the op is flagged by
what it does, not by whether this device happens to be asynchronous.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that read a device value on the host, or whose output shape depends on values.
_ALWAYS = {
    aten._local_scalar_dense.default: ".item() / int() / float() / bool() of a tensor",
    aten.is_nonzero.default: "bool() of a tensor",
    aten.equal.default: "torch.equal (returns a Python bool)",
    aten.nonzero.default: "nonzero (output shape depends on values)",
    aten.masked_select.default: "masked_select (output shape depends on values)",
    aten._unique.default: "unique (output shape depends on values)",
    aten._unique2.default: "unique (output shape depends on values)",
    aten.unique_dim.default: "unique (output shape depends on values)",
    aten.unique_consecutive.default: "unique_consecutive (output shape depends on values)",
    aten.lift_fresh.default: "a tensor built from Python data (a host-to-device copy inside the step)",
}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostSyncError(RuntimeError):
    """An op that forces a host-device sync ran inside a region that must have none."""


def _leaves(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _leaves(a)
        else:
            yield a


def why_it_syncs(func, args, kwargs) -> str | None:
    """The reason `func(*args, **kwargs)` forces a host sync (or a host copy), or None."""
    if func in _ALWAYS:
        return _ALWAYS[func]
    if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size (reads the repeats on the host)"
    if func in _INDEX_OPS and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                  for t in _leaves(args[1:2])):
        return f"{func} with a boolean mask (output shape depends on values)"
    if func is aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        if dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu":
            return f"a copy to the CPU from {src.device} (.cpu() / .to('cpu'))"
    if func in (aten.copy_.default, aten.copy.default):
        dst, src = args[0], args[1]
        if dst.device.type == "cpu" and src.device.type != "cpu":
            return f"a copy into a CPU tensor from {src.device}"
    return None


class NoHostSync(TorchDispatchMode):
    """`with NoHostSync(): step()` raises HostSyncError at the first op that forces a host sync
    (see why_it_syncs); `allow` names ops (OpOverloads) to let through."""

    def __init__(self, allow=()):
        super().__init__()
        self.allow = set(allow)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.allow:
            reason = why_it_syncs(func, args, kwargs)
            if reason is not None:
                raise HostSyncError(f"{func} forces a host sync inside a step that must have none: "
                                    f"{reason}")
        return func(*args, **kwargs)
