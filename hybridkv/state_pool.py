"""Whole-object recurrent-state slots: per recurrent layer `conv[num_slots, ...]` and `ssm[num_slots, ...]`.

Slot 0 is the null slot (padding rows point at it). Every other slot is free, live (owned by one
running request, written in place by the kernels), a checkpoint (immutable, owned by the prefix
cache) or a draft slot (the state after one token of a draft being verified, for one step). The
pool records which, so conservation can be checked; owners are the manager's business.
"""
from __future__ import annotations

import contextlib
import math
from typing import Mapping, Optional

import numpy as np
import torch

from hybridkv.layer_loads import Charge, LayerLoads
from hybridkv.specs import RecurrentSpec

FREE, LIVE, CHECKPOINT, DRAFT, NULL = "free", "live", "checkpoint", "draft", "null"
# Above this many bytes per slot a tensor's deferred copies run one by one (measured on the CPU:
# a gather of 2-16 slots of 128 KiB costs ~1.6-2.6x the copies; of 1 KiB slots, 0.3-0.7x)
_GATHER_MAX_SLOT_BYTES = 16 << 10
# The same choice on the CPU, where a slot is one numpy element of its bytes (measured over random
# slots of 576: 16 slots of 8 KiB gathered 20 us, copied one by one 26; of 32 KiB 106 vs 86;
# 4 of 8 KiB 8 vs 8; 2 of 1 KiB 3.4 vs 3.0)
_ROWS_GATHER_MIN_SLOTS = 4
_ROWS_GATHER_MAX_SLOT_BYTES = 8 << 10


def _slots(num_slots: int, shape: tuple, dtype: torch.dtype, layout, device) -> torch.Tensor:
    """[num_slots, *shape] of `dtype`, or under a quantized cache dtype [num_slots, layout.nbytes] uint8."""
    if layout is not None:
        return layout.empty((num_slots,), device)
    return torch.zeros(num_slots, *shape, dtype=dtype, device=device)


class StatePool:
    """conv[layer]: [num_slots, *conv_shape]; ssm[layer]: [num_slots, *state_shape]; under a
    quantized cache dtype (RecurrentSpec.cache_dtype) each is [num_slots, nbytes] uint8 of codes and
    scales (hybridkv/cache_dtype.py), which the model reads through scheduler/cache_staging.py.

    A layer whose conv_shape (or state_shape) is () has no conv (or ssm) tensor.

    `mirror` (None unless tensor-parallel: hybridkv/parallel/pool_mirror.py) is told of every data
    move: `copied(src, dst)`; `gathered(slot, mine, device, pin)` turns this pool's copy into every
    rank's channels; `scattered(slot, conv, ssm, layers)` takes every rank's and returns this pool's.

    `loads` (hybridkv/layer_loads.py; the manager's, shared with its block pools) takes every write
    from the host (`from_host`), done layer by layer before each layer runs; every other move and
    read here settles it first.
    """

    def __init__(self, specs: Mapping[int, RecurrentSpec], num_slots: int, device: torch.device | str = "cpu"):
        self.num_slots = num_slots if specs else 0
        self.conv: dict[int, torch.Tensor] = {
            i: _slots(self.num_slots, s.conv_shape, s.dtype, s.conv_layout, device)
            for i, s in specs.items() if s.conv_shape
        }
        self.ssm: dict[int, torch.Tensor] = {
            i: _slots(self.num_slots, s.state_shape, s.ssm_dtype, s.ssm_layout, device)
            for i, s in specs.items() if s.state_shape
        }
        self.kind: list[str] = [NULL] + [FREE] * max(0, self.num_slots - 1)
        self._free: list[int] = list(range(self.num_slots - 1, 0, -1))  # pop() hands out low ids first
        self._pending: Optional[dict[int, int]] = None  # dst -> src while copies are deferred
        self.mirror = None
        self.loads = LayerLoads(device)
        # On the CPU every tensor also as numpy views of its bytes (no copy): rows [num_slots, bytes
        # a slot], and [num_slots] of one void element a slot (a gather moves whole slots); a slot
        # copy there costs ~1 us against ~9 us for torch's index + copy_ dispatch
        self._rows: Optional[list[np.ndarray]] = None
        self._slots: list[np.ndarray] = []
        tensors = list(self._tensors())
        if all(t.device.type == "cpu" for t in tensors):
            self._rows = [t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8).numpy() for t in tensors]
            self._slots = [a.view(np.dtype((np.void, a.shape[1]))).reshape(a.shape[0]) if a.shape[1] else a
                           for a in self._rows]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def count(self, kind: str) -> int:
        return self.kind.count(kind)

    def allocate(self, kind: str = LIVE) -> Optional[int]:
        """A free slot marked `kind` (LIVE, CHECKPOINT or DRAFT), or None when none is free. Contents are stale."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.kind[slot] = kind
        return slot

    def free(self, slot: int) -> None:
        if self.loads.pending:  # (its pending writes land before a new owner's)
            self.loads.settle()
        if slot <= 0 or self.kind[slot] == FREE:
            raise RuntimeError(f"slot {slot} freed twice or is the null slot")
        self.kind[slot] = FREE
        self._free.append(slot)

    def mark(self, slot: int, kind: str) -> None:
        """Hand a slot to another owner without copying (a live slot donated as a checkpoint)."""
        self.kind[slot] = kind

    def copy(self, src: int, dst: int) -> None:
        """Copy slot `src` into slot `dst` in every recurrent layer (copy-on-hit, fork, checkpoint).
        Inside `deferred_copies()` it is only recorded."""
        if self.mirror is not None:
            self.mirror.copied(src, dst)
        if self._pending is not None:
            self._pending.pop(dst, None)  # a later copy into the same slot wins, as it would in order
            self._pending[dst] = src
            return
        if self.loads.pending:
            self.loads.settle()
        if self._rows is not None:
            for a in self._rows:
                a[dst] = a[src]
            return
        for t in self._tensors():
            t[dst].copy_(t[src])

    @contextlib.contextmanager
    def deferred_copies(self):
        """Copies made inside run at the exit: a tensor whose slots are small takes them all as
        one gather and one scatter (a step's checkpoints: one pair of calls per layer instead of
        one copy per request and layer); one with large slots copies each in place (a gather
        would move its bytes twice, and there the bytes cost more than the calls). On the CPU
        both run on numpy views of the tensors' bytes (`_rows`: a slot copy ~1 us there, ~9 us
        through torch's dispatch). Only for work whose copies read slots nothing in it writes
        (sources are live slots)."""
        if self._pending is not None:  # nested: the outer one runs them
            yield
            return
        self._pending = {}
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            if pending:
                self._copy_all(list(pending.values()), list(pending))

    def _copy_all(self, srcs: list[int], dsts: list[int]) -> None:
        """Copy slot srcs[i] into dsts[i] for all i in every tensor (no dst is a src)."""
        if self.loads.pending:
            self.loads.settle()
        index = None
        if self._rows is not None:  # CPU: numpy on the bytes
            gather = len(dsts) >= _ROWS_GATHER_MIN_SLOTS
            for a, whole in zip(self._rows, self._slots):
                if gather and a.shape[1] <= _ROWS_GATHER_MAX_SLOT_BYTES:
                    if index is None:
                        index = (np.array(srcs, dtype=np.intp), np.array(dsts, dtype=np.intp))
                    whole[index[1]] = whole[index[0]]
                else:
                    for src, dst in zip(srcs, dsts):
                        a[dst] = a[src]
            return
        for t in self._tensors():
            if len(dsts) > 1 and t[0].numel() * t.element_size() <= _GATHER_MAX_SLOT_BYTES:
                if index is None:  # one host-to-device copy for both index rows
                    index = torch.tensor([srcs, dsts], dtype=torch.long, device=t.device)
                t.index_copy_(0, index[1], t.index_select(0, index[0]))
            else:
                for src, dst in zip(srcs, dsts):
                    t[dst].copy_(t[src])

    def to_host(self, slot: int, device: torch.device | str = "cpu", pin: bool = False) -> tuple[dict, dict]:
        """Copy one slot out: `({layer: conv[conv_shape]}, {layer: ssm[state_shape]})` on `device`.
        Inside `deferred_copies()` a slot that a pending copy fills is read from that copy's source."""
        if self._pending:
            slot = self._pending.get(slot, slot)
        if self.loads.pending:
            self.loads.settle()
        if self.mirror is not None:  # every rank's channels
            return self.mirror.gathered(slot, self._slot_out(slot, "cpu", False), device, pin)
        return self._slot_out(slot, device, pin)

    def _slot_out(self, slot: int, device: torch.device | str, pin: bool) -> tuple[dict, dict]:
        def out(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape[1:], dtype=t.dtype, device=device, pin_memory=pin).copy_(t[slot])
        return {i: out(t) for i, t in self.conv.items()}, {i: out(t) for i, t in self.ssm.items()}

    def from_host(self, slot: int, conv: Mapping[int, torch.Tensor], ssm: Mapping[int, torch.Tensor],
                  charge: Charge = None) -> None:
        """Write one slot's conv and ssm tensors (shapes as `to_host` returns them) into `slot`, each
        layer's before that layer next runs (`loads`); `charge(seconds)` is told the time it takes."""
        if self._pending:  # a pending copy into this slot (made for its previous owner) must not overwrite it
            self._pending.pop(slot, None)
        if self.mirror is not None:  # every rank's channels: this pool keeps its own
            conv, ssm = self.mirror.scattered(slot, conv, ssm, (tuple(self.conv), tuple(self.ssm)))
        writes = {}
        for tensors, src in ((self.conv, conv), (self.ssm, ssm)):
            for i, t in tensors.items():
                write = _slot_write(t[slot], src[i])
                before = writes.get(i)  # (a layer with conv and ssm: one key, both writes)
                writes[i] = write if before is None else _both(before, write)
        self.loads.load(writes, charge)

    def _tensors(self):
        yield from self.conv.values()
        yield from self.ssm.values()


def _slot_write(dst: torch.Tensor, src: torch.Tensor):
    return lambda: dst.copy_(src, non_blocking=True)


def _both(a, b):
    def write() -> None:
        a()
        b()
    return write
