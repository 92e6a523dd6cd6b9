"""Layer-wise loads: host -> device writes into the pools (a promotion from the host or disk tier,
a swap-in, an import) that need only be done before the layer they fill runs.

A write is recorded per cache key (the model's layer index: `ModelCaches.kv[i]`, `conv[i]`,
`state[i]`). The model's access to a key's pool tensor (`LoadedLayers.__getitem__`: every model
reads its layer's pools through ModelCaches before that layer's kernels run) calls `wait(key)`:

- On CUDA the writes are issued at once on a side copy stream, which first waits on the compute
  stream (a kernel still reading a slot or block is not overwritten), each key's writes followed
  by a recorded event; `wait(key)` makes the compute stream wait on that event, so the copies of
  later layers overlap the compute of earlier ones (vLLM's `wait_for_layer_load`).
- On the CPU (no streams) a key's writes are kept and run at `wait(key)`, in the order they were
  made (a later write into the same slot wins, as in-order copies would). So every reader that
  misses the wait reads stale memory, and the CPU tests catch it.

Every other reader or writer of the pools settles first (`settle`: every key): the pools' own
copies, gathers and reads (StatePool, BlockPool), a CUDA graph's capture and replay (no event is
waited on inside a capture), the end of each step (nothing stays pending across steps).

Time: a promotion's caller times the issue (the tiers' `promotion_seconds`), and on the CPU its
`charge(seconds)` adds the time its writes take when they run at the wait; so promotion_seconds
is the host time a promotion costs (on CUDA the issue alone: the wait only enqueues an event wait,
and the copy's device time overlaps the step's compute; benchmarks/gpu_first.sh times the step).
With HYBRIDKV_IMMEDIATE_LOADS=1 the writes run when made (the old immediate copy; for
benchmarks/gpu_first.sh's comparison).
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Callable, Hashable, Iterator, Optional

import torch

Write = Callable[[], None]
Charge = Optional[Callable[[float], None]]


class LayerLoads:
    """Pending host -> device writes into one device's pools, by cache key (see the module)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.immediate = os.environ.get("HYBRIDKV_IMMEDIATE_LOADS", "") == "1"
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and not self.immediate else None
        # key -> CPU: [(write, charge)] in order; CUDA: the event after the key's last writes
        self._pending: dict[Hashable, object] = {}

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def load(self, writes: Mapping[Hashable, Write], charge: Charge = None) -> None:
        """One promotion: {cache key: a call writing that key's piece into its pool tensor}. On the
        CPU `charge(seconds)` is told the time each write takes when it runs at the wait (the
        caller times the issue: the whole write where it runs at once)."""
        if self.immediate:
            for write in writes.values():
                write()
        elif self.stream is None:
            for key, write in writes.items():
                self._pending.setdefault(key, []).append((write, charge))
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for key, write in writes.items():
                    write()
                    event = torch.cuda.Event()
                    event.record(self.stream)
                    self._pending[key] = event  # (one stream: a later event follows every earlier write)

    def wait(self, key: Hashable) -> None:
        """Before the layer of `key` runs: its writes are done (CPU) or the compute stream waits on them."""
        got = self._pending.pop(key, None)
        if got is None:
            return
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(got)
            return
        for write, charge in got:
            t0 = time.perf_counter()
            write()
            if charge is not None:
                charge(time.perf_counter() - t0)

    def settle(self) -> None:
        """Every pending write done (or waited on by the compute stream)."""
        for key in list(self._pending):
            self.wait(key)


class LoadedLayers(Mapping):
    """{cache key: pool tensor} that waits on the key's pending loads when a tensor is read: what
    ModelCaches holds, so a layer's pools are loaded just before the layer uses them."""

    __slots__ = ("tensors", "loads")

    def __init__(self, tensors: Mapping[Hashable, torch.Tensor], loads: LayerLoads):
        self.tensors, self.loads = tensors, loads

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        t = self.tensors[key]
        if self.loads._pending:
            self.loads.wait(key)
        return t

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, key) -> bool:
        return key in self.tensors
