"""The tensor-parallel process group: ranks 0..N-1 on 127.0.0.1, every wait bounded.

Two torch.distributed process groups over one TCPStore: `control` (gloo, CPU objects: rank 0's
decisions) and `model` (the all-reduces inside the forward: NCCL on CUDA, the same gloo group on
CPU). Groups are built directly on the store, not as the process-wide default group, so several
engines (and the snapshot transport) can live in one process. Every collective gives up after
`timeout_s`; a dead or stuck rank raises RankFailedError instead of hanging.
"""
from __future__ import annotations

import datetime
import pickle
import socket
from typing import Any

import torch
import torch.distributed as dist


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot continue."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """This process's membership: `rank` of `size`, collectives with byte counters.

    Rank 0 creates the store (`is_master`); ranks 1.. connect to it and set `joined/<rank>`;
    rank 0 calls `wait_for(store)` (which polls those keys and the processes) before the groups
    rendezvous. `device` is where model tensors live: a CUDA device selects NCCL for the model group.
    """

    def __init__(self, rank: int, size: int, port: int, device: torch.device, timeout_s: float = 30.0,
                 wait_for=None):
        self.rank, self.size, self.port = rank, size, port
        self.timeout_s = float(timeout_s)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        if rank == 0 and wait_for is not None:
            wait_for(self.store)  # every other rank has connected (or a clear error): no blind wait
        else:
            self.store.set(f"joined/{rank}", b"1")
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), rank, size, timeout)
        self.model = self.control
        if torch.device(device).type == "cuda":
            self.model = dist.ProcessGroupNCCL(dist.PrefixStore("model", self.store), rank, size)
        self.bytes = {"all_reduce": 0, "broadcast": 0, "gather": 0}
        self.failure: RankFailedError | None = None  # the first lost collective: the group is done

    # ---- inside the forward ----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over ranks (in place on a contiguous copy); returns the sum."""
        t = t.contiguous()
        self.bytes["all_reduce"] += t.numel() * t.element_size()
        self._wait(self.model.allreduce([t]), "all-reduce")
        return t

    # ---- rank 0's decisions ----------------------------------------------------------------
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj` (pickled) to every rank; every rank returns it."""
        size = torch.zeros(1, dtype=torch.int64)
        payload = None
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            size[0] = payload.numel()
        self._wait(self.control.broadcast(size, 0), "broadcast")
        if self.rank != 0:
            payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self._wait(self.control.broadcast(payload, 0), "broadcast")
        self.bytes["broadcast"] += int(size[0]) + 8
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def gather_objects(self, obj: Any = None) -> list:
        """Every rank gives `obj`; rank 0 returns them in rank order ([obj] elsewhere)."""
        tag = 7
        if self.rank != 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            self._wait(self.control.send([size], 0, tag), "send")
            self._wait(self.control.send([payload], 0, tag), "send")
            self.bytes["gather"] += payload.numel() + 8
            return [obj]
        out = [obj]
        for r in range(1, self.size):
            size = torch.zeros(1, dtype=torch.int64)
            self._wait(self.control.recv([size], r, tag), "recv")
            payload = torch.empty(int(size[0]), dtype=torch.uint8)
            self._wait(self.control.recv([payload], r, tag), "recv")
            self.bytes["gather"] += int(size[0]) + 8
            out.append(pickle.loads(payload.numpy().tobytes()))
        return out

    def _wait(self, work, what: str) -> None:
        if self.failure is not None:
            raise RankFailedError(str(self.failure))
        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout_s))
            if ok is False:
                raise TimeoutError(f"no answer within {self.timeout_s:g} s")
        except Exception as e:  # gloo: a peer closed its connection, or the timeout passed
            self.failure = RankFailedError(
                f"tensor-parallel {what} on rank {self.rank} of {self.size} failed ({type(e).__name__}: "
                f"{e}); a rank has died or stopped answering — this engine cannot continue")
            raise self.failure from e

    def close(self) -> None:
        for pg in {id(self.model): self.model, id(self.control): self.control}.values():
            try:
                pg.shutdown()
            except Exception:  # already broken: nothing left to release
                pass
