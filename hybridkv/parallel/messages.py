"""What rank 0 sends ranks 1..N-1 besides pool moves (pool_moves.py): the pools' plan, a step's
model inputs, stop. A message is a list of these, applied in order."""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch


@dataclass(frozen=True)
class Forward:
    """Run this rank's shard of the model on the step's inputs: a ForwardBatch's fields on the CPU
    (`batch_fields`); its all-reduces meet rank 0's."""

    batch: dict


@dataclass(frozen=True)
class Stop:
    """The engine closes: the rank exits."""


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
