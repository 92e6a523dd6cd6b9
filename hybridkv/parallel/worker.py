"""Ranks 1..N-1 of a tensor-parallel engine: load the shard (only its rows of the checkpoint:
shard_loading.py), then apply rank 0's messages forever.

A worker owns no scheduler and no bookkeeping. Each message from rank 0 is a list of operations,
applied in order: journaled pool moves (mirrored_pools.py), reads answered to rank 0, and
`("forward", batch fields)`, which runs this rank's shard of the model on its own pools (the
all-reduces inside meet rank 0's). `("stop",)` ends the loop. A worker waits for the next
message in short store waits and exits when rank 0's process is gone.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Optional

import torch

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


def moved(value, device):
    """`value` with every tensor in it (inside dicts, lists and dataclasses too) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: moved(getattr(value, f.name), device) for f in fields(value) if f.init})
    return value


def batch_fields(batch) -> dict:
    """A ForwardBatch's fields on the CPU, picklable (kernel plans are rebuilt by each rank)."""
    return {f.name: moved(getattr(batch, f.name), "cpu") for f in fields(batch) if f.name != "kernel_plans"}


def _batch(values: dict, device: torch.device):
    from hybridkv.models.forward_batch import ForwardBatch

    return ForwardBatch(**moved(values, device))


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
    from hybridkv.models import load_model
    from hybridkv.scheduler.profiler import profile_model

    from .group import TensorParallelGroup
    from .mirrored_pools import ShardedPools
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
        layouts = shard.layouts
    except BaseException as e:
        group.store.set(ready, f"error: {type(e).__name__}: {e}")
        raise
    group.store.set(ready, "ok")
    num_tokens, peak_tokens = args.profile_tokens
    profile_model(model, args.block_size, num_tokens=num_tokens, peak_tokens=peak_tokens)  # as rank 0
    pools, n = None, 0
    try:
        while True:
            _wait_message(group, n, parent)
            n += 1
            ops = group.broadcast_object()
            answers = []
            for op in ops:
                kind = op[0]
                if kind == "stop":
                    return
                if kind == "plan":
                    pools = ShardedPools(model.cache_specs(), layouts, args.rank, args.size, op[1], device)
                elif kind == "forward":
                    from hybridkv.models.forward_batch import ModelCaches

                    caches = ModelCaches(kv=pools.kv, conv=pools.states.conv, state=pools.states.ssm,
                                         block_size=pools.block_size)
                    with torch.inference_mode():
                        model(_batch(op[1], device), caches)
                else:
                    with torch.inference_mode():
                        answer = pools.apply(op)
                    if answer is not None:
                        answers.append(answer)
            for answer in answers:
                group.gather_objects(answer)
    finally:
        group.close()
