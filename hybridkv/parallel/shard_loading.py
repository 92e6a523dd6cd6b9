"""Load one tensor-parallel rank's shard of a checkpoint, never the whole checkpoint.

    shard = ShardLoad(rank, size, all_reduce)
    model = load_model(path, ..., shard=shard)   # shard.cut on the meta model, shard.load for weights
    shard.layouts, shard.full_specs              # as shard_model returns / the specs before the cut

`cut` runs sharding.shard_model on the model while it is still on the `meta` device, so only the
shard's parameters are ever allocated. `load` fills them: a parameter the model loads under its
own checkpoint name is read with safetensors' `get_slice`, only the rows this rank keeps; one a
family assembles from other tensors (experts stacked from per-expert tensors, renamed or fused
published tensors) arrives whole from the family's view, ONE tensor at a time, and is cut on copy.
A row-parallel bias that only rank 0 adds is not read at all on the other ranks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from safetensors import safe_open

from .param_cuts import Cut
from .sharding import shard_model


class ShardLoad:
    """What `load_model(shard=...)` calls: `cut(meta model)`, then `load(model, checkpoint)`.

    all_reduce: the rank's sum over ranks, used by the forward (None: bind it later with `bind`,
    as rank 0 does, whose process group starts after its model is loaded)."""

    def __init__(self, rank: int, size: int, all_reduce: Optional[Callable] = None):
        self.rank, self.size = rank, size
        self._all_reduce = all_reduce
        self.layouts: dict = {}
        self.full_specs: dict = {}

    def bind(self, all_reduce: Callable) -> None:
        self._all_reduce = all_reduce

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._all_reduce is None:
            raise RuntimeError("ShardLoad: the model ran before its all-reduce was bound (bind())")
        return self._all_reduce(t)

    def cut(self, model) -> None:
        """Cut `model` (on the meta device) to this rank's shard: ValueError (naming the value)
        for a family or shape that cannot be split, before any weight is allocated or read."""
        self.full_specs = model.cache_specs()
        full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.layouts = shard_model(model, self.rank, self.size, self._reduce)
        # {name: (full shape, Cut)}: allocation (meta -> device) makes new parameter objects
        self._cuts = {name: (full_shapes[name], p.tp_cut) for name, p in model.named_parameters()
                      if getattr(p, "tp_cut", None) is not None}

    def load(self, model, ckpt) -> None:
        """Fill `model`'s shard from `ckpt` (a CheckpointTensors) through the family's own
        load_weights (its names, views, shape checks), each cut parameter standing in full size."""
        swapped = []  # (module, attribute, the real parameter), put back after loading
        by_source = {}  # checkpoint name -> the stand-in it fills when loaded under that name
        for name, p in list(model.named_parameters()):
            if name not in self._cuts:
                continue
            owner, leaf = _owner(model, name)
            stand_in = CutOnCopy(p, *self._cuts[name], self.rank, self.size)
            swapped.append((owner, leaf, p))
            owner._parameters[leaf] = stand_in
            source = model.checkpoint_name(name)
            if source is not None:
                by_source[source] = stand_in
        try:
            model.load_weights(SliceReader(ckpt, by_source))
        finally:
            for owner, leaf, p in swapped:
                owner._parameters[leaf] = p


def _owner(model, name: str):
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module, leaf


class CutOnCopy:
    """Stands in for a cut parameter while the family's load_weights runs: it reports the FULL
    shape (what the checkpoint holds, so the family's shape check passes) and `data.copy_(t)`
    copies only this rank's rows of `t` (or the SliceRead's rows, read from disk) into the shard."""

    def __init__(self, param: torch.nn.Parameter, full_shape: tuple, cut: Cut, rank: int, size: int):
        self.param, self.shape, self.cut, self.rank, self.size = param, torch.Size(full_shape), cut, rank, size
        self.dtype, self.device = param.dtype, param.device

    @property
    def data(self) -> "CutOnCopy":
        return self

    def detach(self) -> "CutOnCopy":  # state_dict() without keep_vars (Zamba2 lists tied names so)
        return self

    def copy_(self, src) -> None:
        if self.cut.zeroed:
            self.param.data.zero_()
            return
        if isinstance(src, SliceRead):
            shard = src.read(self.cut, self.rank, self.size)
        else:
            shard = self.cut.layout.take(src, self.rank, self.size, self.cut.dim)
        self.param.data.copy_(shard.to(device=self.param.device, dtype=self.param.dtype))


class SliceRead:
    """A checkpoint tensor not read yet: `shape` is the stored one; `read` loads only the rows a
    Cut keeps, through safetensors' get_slice (one contiguous run of rows at a time), from a
    handle opened for this read alone: its mapping of the file, and the file pages it touched,
    leave this process's resident memory when it closes."""

    def __init__(self, file: str, name: str, shape):
        self.file, self.name, self.shape = file, name, torch.Size(shape)

    def to(self, device=None, dtype=None) -> "SliceRead":
        return self  # the rows are cast when copied (CutOnCopy)

    def read(self, cut: Cut, rank: int, size: int) -> torch.Tensor:
        if cut.zeroed:
            raise ValueError("a zeroed bias is never read")
        rows = cut.layout.index(rank, size).tolist()
        runs, start = [], 0
        for k in range(1, len(rows) + 1):  # consecutive positions -> one slice each
            if k == len(rows) or rows[k] != rows[k - 1] + 1:
                runs.append((rows[start], rows[k - 1] + 1))
                start = k
        lead = (slice(None),) * cut.dim
        with safe_open(self.file, framework="pt", device="cpu") as handle:
            rows_of = handle.get_slice(self.name)
            parts = [rows_of[lead + (slice(a, b),)] for a, b in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=cut.dim)


class SliceReader:
    """The checkpoint as the family's load_weights sees it: `get(name)` of a tensor that fills a
    cut parameter directly is a SliceRead (nothing read yet); any other name is read whole by
    `ckpt` (a replicated parameter, or a piece a family view assembles)."""

    def __init__(self, ckpt, cut_targets: dict):
        self.ckpt = ckpt
        self.targets = cut_targets  # checkpoint name -> the CutOnCopy it fills
        self._files, self._shapes = {}, {}
        for f in ckpt.files():  # headers only: no tensor data is touched
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    self._files[name] = str(f)
                    self._shapes[name] = handle.get_slice(name).get_shape()

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def get(self, name: str):
        target = self.targets.get(name)
        if target is None or name not in self._files:
            return self.ckpt.get(name)
        if target.cut.zeroed:  # rank 0 adds this bias; others hold zeros: nothing to read
            return _Unread(target.shape)
        return SliceRead(self._files[name], name, self._shapes[name])

    def __getattr__(self, attr):  # names(), files(), identity() ... as the checkpoint's
        return getattr(self.ckpt, attr)


class _Unread:
    """The shape of a tensor that is not read (a zeroed bias on a rank other than 0)."""

    def __init__(self, shape):
        self.shape = shape

    def to(self, device=None, dtype=None) -> "_Unread":
        return self
