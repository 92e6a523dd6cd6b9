"""`ReplicaGroup`: the gloo process group that data-parallel replicas join at start-up, and a moved
request's snapshot sent through it rank to rank while the pipe carries only a small header.

    store = host_store(timeout)                                   # the parent: 127.0.0.1, a free port
    group = ReplicaGroup.join(store.port, rank, world_size, join_timeout, timeout)  # each replica
    header, sending = group.send_snapshot(snap, dst)   # the exporter: tensors posted, returns at once
    snap = group.recv_snapshot(header)                 # the importer: blocks until they arrive
    sending.wait()                                     # the exporter, once the importer answered

The group is its own ProcessGroupGloo object, not torch.distributed's default group, so a
replica's own tensor-parallel group is left alone. Messages between two ranks arrive in the order
sent: an importer must receive every header it is handed before anything else can fail, or the
next request would read this one's tensors.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridkv.snapshot import RequestSnapshot

log = logging.getLogger("hybridkv.replicas")
_KINDS = ("kv", "conv", "ssm")
_TAG = 7  # the tag of every snapshot tensor: one stream per pair of ranks, in order


def host_store(timeout: float) -> dist.TCPStore:
    """The rendezvous the replicas meet at: a TCPStore on 127.0.0.1 at a free port (`.port`),
    served by the calling process (keep it while the replicas run)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


@dataclass
class SnapshotHeader:
    """What the pipe carries of a snapshot whose tensors went over gloo: the snapshot with its
    kv / conv / ssm dicts empty, and each tensor's (kind, layer, shape, dtype) in the order sent."""

    snapshot: RequestSnapshot
    tensors: list[tuple[str, int, tuple[int, ...], torch.dtype]]
    src: int

    @property
    def nbytes(self) -> int:
        """Bytes that went over gloo for this snapshot."""
        return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, _, s, d in self.tensors)


@dataclass
class PendingSend:
    """A snapshot's tensors posted to another rank: kept alive until `wait` says they left."""

    tensors: list[torch.Tensor]
    works: list
    timeout: float

    def wait(self) -> bool:
        """True once every tensor was delivered; False (logged) if the receiver died or timed out."""
        try:
            for w in self.works:
                w.wait(datetime.timedelta(seconds=self.timeout))
            return True
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError or its own error types
            log.warning("a snapshot sent over gloo was not delivered: %s", e)
            return False


class ReplicaGroup:
    """Rank `rank` of the replicas' gloo group; `timeout` bounds every receive."""

    def __init__(self, pg, rank: int, timeout: float):
        self.pg, self.rank, self.timeout = pg, rank, timeout

    @classmethod
    def join(cls, port: int, rank: int, world_size: int, join_timeout: float, timeout: float) -> "ReplicaGroup":
        """Meet the other `world_size - 1` replicas at the parent's store (127.0.0.1:`port`);
        returns once all joined, RuntimeError after `join_timeout` seconds (they may still be
        building their models). `timeout` then bounds each receive."""
        delta = datetime.timedelta(seconds=join_timeout)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=delta)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = delta
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return cls(dist.ProcessGroupGloo(dist.PrefixStore("hybridkv-replicas", store), rank, world_size, opts),
                   rank, timeout)

    def send_snapshot(self, snap: RequestSnapshot, dst: int) -> tuple[SnapshotHeader, PendingSend]:
        """Post `snap`'s tensors to rank `dst` (no wait); the header for the pipe and the sends."""
        tensors, specs = [], []
        for kind in _KINDS:
            for layer, t in sorted(getattr(snap, kind).items()):
                t = t.detach().contiguous().cpu()
                tensors.append(t)
                specs.append((kind, layer, tuple(t.shape), t.dtype))
        works = [self.pg.send([t], dst, _TAG) for t in tensors]
        bare = dataclasses.replace(snap, kv={}, conv={}, ssm={})
        return SnapshotHeader(bare, specs, self.rank), PendingSend(tensors, works, self.timeout)

    def recv_snapshot(self, header: SnapshotHeader) -> RequestSnapshot:
        """The snapshot `header` announces, its tensors received from rank `header.src`."""
        parts: dict[str, dict[int, torch.Tensor]] = {k: {} for k in _KINDS}
        for kind, layer, shape, dtype in header.tensors:
            t = torch.empty(shape, dtype=dtype)
            self.pg.recv([t], header.src, _TAG).wait(datetime.timedelta(seconds=self.timeout))
            parts[kind][layer] = t
        return dataclasses.replace(header.snapshot, **parts)
