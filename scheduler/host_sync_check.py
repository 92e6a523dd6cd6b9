"""Catch the ops that make the host wait for the device, so a step can be proven capturable.

A CUDA graph replays device work only: any op whose result the host must read (a `.item()`, a
`.tolist()`, a shape that depends on data) either breaks the capture or freezes one step's value
into every replay. `NoHostSync` (a TorchFunctionMode for host reads of tensors and a
TorchDispatchMode for ops that wait or copy) raises `HostSyncError` at the first such op, naming
it, so the check runs on CPU tensors as well as on a GPU: the op is flagged by what it does, not
by whether this device happens to be asynchronous.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that read a device value on the host, or whose output shape depends on values.
_ALWAYS = {
    aten._local_scalar_dense.default: ".item() / int() / float() / bool() of a tensor",
    aten.item.default: ".item() of a tensor",
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
    if func is aten._to_copy.default and kwargs.get("device") is not None:
        src, dst = args[0].device, torch.device(kwargs["device"])
        if (src.type == "cpu") != (dst.type == "cpu"):
            return f"a copy from {src} to {dst} (.to() / .cpu() between host and device)"
    if func in (aten.copy_.default, aten.copy.default):
        dst, src = args[0].device, args[1].device
        if (src.type == "cpu") != (dst.type == "cpu"):
            return f"a copy into a {dst} tensor from a {src} one (between host and device)"
    return None


_HOST_READS = {  # Tensor methods whose answer is a host value (seen before dispatch: on a CPU
    # tensor tolist/numpy never reach the dispatcher)
    torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()",
    torch.Tensor.__int__: "int() of a tensor", torch.Tensor.__float__: "float() of a tensor",
    torch.Tensor.__bool__: "bool() of a tensor", torch.Tensor.__index__: "a tensor used as a Python int",
}


def _raise(func, reason: str):
    raise HostSyncError(f"{getattr(func, '__name__', func)} forces a host sync inside a step that "
                        f"must have none: {reason}")


class _NoHostReads(TorchFunctionMode):
    def __init__(self, allow):
        super().__init__()
        self.allow = allow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS and func not in self.allow:
            _raise(func, _HOST_READS[func])
        return func(*args, **(kwargs or {}))


class _NoDeviceWaits(TorchDispatchMode):
    def __init__(self, allow):
        super().__init__()
        self.allow = allow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.allow:
            reason = why_it_syncs(func, args, kwargs)
            if reason is not None:
                _raise(func, reason)
        return func(*args, **kwargs)


class NoHostSync:
    """`with NoHostSync(): step()` raises HostSyncError at the first op that forces a host sync:
    a host read of a tensor (.item(), .tolist(), int(), bool(), .numpy(): seen as torch functions)
    or an op that makes the host wait or copy (why_it_syncs: seen at dispatch). `allow` names
    functions or OpOverloads to let through."""

    def __init__(self, allow=()):
        self.allow = set(allow)
        self._modes = []

    def __enter__(self):
        self._modes = [_NoHostReads(self.allow), _NoDeviceWaits(self.allow)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []
        return False
