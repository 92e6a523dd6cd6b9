"""Ranks 1..N-1 of a tensor-parallel engine: load the shard (only its rows of the checkpoint:
shard_loading.py), then apply rank 0's messages until told to stop.

A worker owns no scheduler and no bookkeeping: its `RankRunner` holds this rank's shard of the
model and of every pool. Each message from rank 0 is a list applied in order: the pools' plan
(messages.py: once), pool moves and reads (pool_moves.py: reads are answered to rank 0 after the
list), and `Forward`, which runs this rank's shard of the model on its own pools (the
all-reduces inside meet rank 0's). `Stop` ends the loop. A worker waits for the next message in
short store waits and exits when rank 0's process is gone.
"""
from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass
from typing import Optional

import torch

from hybridkv.layer_loads import LoadedLayers

from .messages import Forward, Stop, moved
from .pool_moves import READS, PoolPlan, ShardedPools

READY_KEY = "ready/{rank}"
MESSAGE_KEY = "message/{n}"


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    size: int
    port: int
    path: str
    device: str
    dtype: object
    max_model_len: Optional[int]
    timeout_s: float
    num_threads: int
    block_size: int
    profile_tokens: tuple  # (num_tokens, peak_tokens) as rank 0's profile_model call


class RankRunner:
    """This rank's model shard and, once rank 0's plan came, its pool shards.

    layouts: {cache layer: CacheShard} from loading the shard."""

    def __init__(self, model, layouts: dict, rank: int, size: int, device: torch.device):
        self.model, self.layouts, self.rank, self.size, self.device = model, layouts, rank, size, device
        self.pools: Optional[ShardedPools] = None

    def apply(self, item):
        """Apply one item of a message; returns this rank's answer to a read (else None)."""
        if isinstance(item, PoolPlan):
            self.pools = ShardedPools(self.model.cache_specs(), self.layouts, self.rank, self.size, item,
                                      self.device)
            return None
        with torch.inference_mode():
            if isinstance(item, Forward):
                self.forward(item.batch)
                return None
            answer = item.apply(self.pools)
        return answer if isinstance(item, READS) else None

    def forward(self, fields: dict) -> None:
        from hybridkv.models.forward_batch import ForwardBatch, ModelCaches

        pools, loads = self.pools, self.pools.loads
        caches = ModelCaches(kv=LoadedLayers(pools.kv, loads), conv=LoadedLayers(pools.states.conv, loads),
                             state=LoadedLayers(pools.states.ssm, loads), block_size=pools.block_size)
        try:
            self.model(ForwardBatch(**moved(fields, self.device)), caches)
        finally:
            loads.settle()  # (nothing stays pending across steps)


def _wait_message(group, n: int, parent: int) -> None:
    """Block until rank 0 announces message n; exit when rank 0's process has gone."""
    key = MESSAGE_KEY.format(n=n)
    while True:
        try:
            group.store.wait([key], datetime.timedelta(seconds=1))
            return
        except Exception:
            if os.getppid() != parent:
                raise SystemExit(f"tensor-parallel rank {group.rank}: rank 0 is gone")


def run_worker(args: WorkerArgs) -> None:
    """The process entry of rank args.rank (torch.multiprocessing spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops us; a Ctrl-C to the group must not
    from hybridkv.models import load_model
    from hybridkv.scheduler.profiler import profile_model

    from .group import TensorParallelGroup
    from .shard_loading import ShardLoad

    torch.set_num_threads(args.num_threads)
    parent = os.getppid()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds this rank's communicator to its own GPU
    group = TensorParallelGroup(args.rank, args.size, args.port, device, args.timeout_s)
    ready = READY_KEY.format(rank=args.rank)
    try:
        shard = ShardLoad(args.rank, args.size, group.all_reduce)  # reads only this rank's rows
        model = load_model(args.path, device=device, dtype=args.dtype, max_model_len=args.max_model_len,
                           shard=shard)
    except BaseException as e:
        group.store.set(ready, f"error: {type(e).__name__}: {e}")
        raise
    group.store.set(ready, "ok")
    num_tokens, peak_tokens = args.profile_tokens
    profile_model(model, args.block_size, num_tokens=num_tokens, peak_tokens=peak_tokens)  # as rank 0
    runner, n = RankRunner(model, shard.layouts, args.rank, args.size, device), 0
    try:
        while True:
            _wait_message(group, n, parent)
            n += 1
            answers = []
            for item in group.broadcast_object():
                if isinstance(item, Stop):
                    return
                answer = runner.apply(item)
                if answer is not None:
                    answers.append(answer)
            for answer in answers:
                group.gather_objects(answer)
    finally:
        group.close()
