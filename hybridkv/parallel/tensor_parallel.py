"""Rank 0 of a tensor-parallel engine: start the other ranks, shard this model, send them messages.

    tp = TensorParallel(model, path, size, ...)   # after load_model, before profile_model
    ... profile_model(model, ...); manager = HybridCacheManager(...)
    Engine(model, manager, scheduler, executor=tp.executor)  # TensorParallelExecutor(runner, tp)
    tp.check()                                     # raises RankFailedError once a rank is lost
    tp.close()

The LLM the user holds is rank 0: its scheduler and its memory manager decide; ranks 1..N-1
(spawned processes, `worker.py`) hold their shards of the weights and of every pool and apply
those decisions. The executor (executor.py) sends each step's pool moves and model inputs with
`send`; a pool read asks with `ask`.
"""
from __future__ import annotations

import os
import time
import weakref
from typing import Optional

import torch
import torch.multiprocessing as mp

from .executor import TensorParallelExecutor
from .group import RankFailedError, TensorParallelGroup, free_port
from .messages import Stop
from .shard_loading import ShardLoad
from .sharding import check_supported, shard_model
from .worker import MESSAGE_KEY, READY_KEY, WorkerArgs, run_worker


def check_size(size, device: torch.device) -> None:
    """ValueError naming tensor_parallel_size when it is not a positive int or the devices lack."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be a positive integer (1: one device)")
    if size > 1 and mp.current_process().daemon:
        raise ValueError(f"tensor_parallel_size={size} inside a daemon process is not supported: its ranks "
                         f"would be child processes of a daemon; build the engine in a non-daemon process "
                         f"(data-parallel replicas with tensor_parallel_size > 1 are started as such)")
    if device.type == "cuda" and size > 1:
        have = torch.cuda.device_count() - (device.index or 0)
        if have < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices from {device}; "
                             f"{have} are visible")


START_TIMEOUT_S = 300.0  # spawn, import, load the shard: slow on a busy host, bounded all the same
# every collective after start-up gives up after this long (HYBRIDKV_TP_TIMEOUT_S overrides)
STEP_TIMEOUT_S = float(os.environ.get("HYBRIDKV_TP_TIMEOUT_S", "30"))


class TensorParallel:
    """Rank 0's side of `size` ranks over torch.distributed (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, model, path: str, size: int, *, dtype, max_model_len: Optional[int],
                 block_size: int, profile_tokens: tuple[int, int], timeout_s: float = STEP_TIMEOUT_S,
                 shard: Optional[ShardLoad] = None):
        """profile_tokens: (num_tokens, peak_tokens) of rank 0's profile_model call, which every
        rank repeats (its forwards meet in the same all-reduces). shard: the ShardLoad `model` was
        loaded with (rank 0's rows only); None: `model` is whole and is cut here, in place."""
        check_size(size, model.device)
        check_supported(model.architecture, size)
        self.size = size
        self.model = model
        if shard is not None:
            if (shard.rank, shard.size) != (0, size):
                raise ValueError(f"rank 0 of tensor_parallel_size={size} was loaded as rank {shard.rank} "
                                 f"of {shard.size}")
            self.full_specs, self.layouts = shard.full_specs, shard.layouts
            shard.bind(lambda t: self.group.all_reduce(t))
        else:
            self.full_specs = model.cache_specs()
            # cut rank 0 first: a shape that cannot split is refused before any process starts
            self.layouts = shard_model(model, 0, size, lambda t: self.group.all_reduce(t))
        port = free_port()
        dev = model.device
        ctx = mp.get_context("spawn")
        self.procs = []
        for r in range(1, size):
            wdev = f"cuda:{(dev.index or 0) + r}" if dev.type == "cuda" else str(dev)
            args = WorkerArgs(r, size, port, str(path), wdev, dtype, max_model_len, timeout_s,
                              torch.get_num_threads(), block_size, profile_tokens)
            p = ctx.Process(target=run_worker, args=(args,), daemon=True, name=f"hybridkv-tp-rank{r}")
            _start_quietly(p)
            self.procs.append(p)
        self._finalizer = weakref.finalize(self, _terminate, list(self.procs))
        self.group: Optional[TensorParallelGroup] = None
        self.failure: Optional[RankFailedError] = None
        self._sent = 0
        try:
            self.group = TensorParallelGroup(0, size, port, dev, timeout_s,
                                             wait_for=lambda store: self._wait_keys(store, "joined/{rank}"))
            self._wait_keys(self.group.store, READY_KEY)
        except BaseException:
            self.close()
            raise

    def _wait_keys(self, store, key_format: str) -> None:
        """Wait until every other rank has set its key ("ok" or an error) or exited: bounded by
        START_TIMEOUT_S, and at once when a rank's process is gone."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for r, p in enumerate(self.procs, start=1):
            key = key_format.format(rank=r)
            while not store.check([key]):
                if not p.is_alive():
                    raise RankFailedError(f"tensor-parallel rank {r} exited (code {p.exitcode}) while starting")
                if time.monotonic() > deadline:
                    raise RankFailedError(f"tensor-parallel rank {r} did not start within {START_TIMEOUT_S:g} s")
                time.sleep(0.05)
            answer = store.get(key).decode()
            if answer not in ("ok", "1"):
                raise RankFailedError(f"tensor-parallel rank {r} could not load its shard: {answer}")

    # ---- after the manager exists ----------------------------------------------------------
    def executor(self, runner) -> TensorParallelExecutor:
        """The executor of an engine whose rank 0 runs `runner` (mirrors its manager's pools)."""
        return TensorParallelExecutor(runner, self)

    def send(self, items: list) -> None:
        """Announce message n in the store, then broadcast `items` (applied in order by every
        rank: messages.py, pool_moves.py); a lost rank raises RankFailedError."""
        self.check()
        try:
            for r, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    raise RankFailedError(f"tensor-parallel rank {r} of {self.size} exited (code "
                                          f"{p.exitcode}); this engine cannot continue — create a new LLM")
            self.group.store.set(MESSAGE_KEY.format(n=self._sent), b"1")
            if self._sent >= 2:  # every rank is past it: message n-1 was a forward or a read
                self.group.store.delete_key(MESSAGE_KEY.format(n=self._sent - 2))
            self._sent += 1
            self.group.broadcast_object(items)
        except RankFailedError as e:
            self.failure = e
            raise

    def ask(self, items: list) -> list:
        """`send(items)` whose last item is a read (pool_moves.py); returns ranks 1..N-1's answers."""
        self.send(items)
        return self.group.gather_objects(None)[1:]

    def check(self) -> None:
        """Raise the RankFailedError that ended this engine, if any (also one an all-reduce hit)."""
        if self.failure is None and self.group is not None and self.group.failure is not None:
            self.failure = self.group.failure
        if self.failure is not None:
            raise RankFailedError(str(self.failure))

    def communication_bytes(self) -> dict:
        """Bytes this rank sent or received per collective kind since start."""
        return dict(self.group.bytes)

    def close(self) -> None:
        """Stop the other ranks (a 'stop' message, then terminate after a bounded join)."""
        if self.group is not None and self.failure is None and all(p.is_alive() for p in self.procs):
            try:
                self.send([Stop()])
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
        self._finalizer()
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.failure is None:
            self.failure = RankFailedError("this engine's tensor-parallel ranks were stopped (LLM.close()); "
                                           "create a new LLM")


def _start_quietly(process) -> None:
    """Start `process` with torch's C++ log at ERROR: its idle store waits time out every second."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # the spawned child copies the environment now
    try:
        process.start()
    finally:
        if before is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = before


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
