"""How one parameter of a module is cut to a tensor-parallel rank's shard, in place (sharding.py
says which parameters, per family): column-parallel (output rows), row-parallel (input columns;
the bias on rank 0 only), any dimension by a ShardLayout; and the sum over ranks that a
row-parallel layer then does inside its forward (models/row_parallel.py). Each cut parameter
keeps its `Cut` as `tp_cut`, so a loader can read just its shard (shard_loading.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from hybridkv.models.fused_linear import FusedLinear
from hybridkv.models.row_parallel import RowParallel

from .shard_layout import ShardLayout


@dataclass(frozen=True)
class Cut:
    """How a parameter was cut from the full one: rows `layout` gives the rank along `dim`, or,
    with `zeroed`, a row-parallel bias that only rank 0 adds (zeros elsewhere). Kept on the new
    parameter as `tp_cut`, so a loader can read just the shard (shard_loading.py)."""

    layout: Optional[ShardLayout] = None
    dim: int = 0
    zeroed: bool = False


def set_param(module: nn.Module, name: str, value: torch.Tensor, cut: Cut) -> None:
    param = nn.Parameter(value.contiguous(), requires_grad=False)
    param.tp_cut = cut
    setattr(module, name, param)


def keep(module: nn.Module, name: str, layout: ShardLayout, rank: int, size: int, dim: int) -> None:
    """Replace parameter `name` of `module` by the rows `layout` gives `rank` along `dim`."""
    t = getattr(module, name).data
    if t.shape[dim] != layout.full:
        raise ValueError(f"tensor of shape {tuple(t.shape)} does not match the shard layout "
                         f"({layout.full} at dim {dim})")
    set_param(module, name, layout.take(t, rank, size, dim), Cut(layout, dim))


def zero_unless_rank0(module: nn.Module, name: str, rank: int) -> None:
    """A bias added after a sum over ranks: rank 0 keeps it, the others hold zeros."""
    if rank != 0:
        set_param(module, name, torch.zeros_like(getattr(module, name).data), Cut(zeroed=True))


def column(lin: nn.Linear, layout: ShardLayout, rank: int, size: int) -> None:
    """Keep the output rows `layout` gives this rank."""
    keep(lin, "weight", layout, rank, size, 0)
    if lin.bias is not None:
        keep(lin, "bias", layout, rank, size, 0)
    lin.out_features = lin.weight.shape[0]


def row(lin: nn.Linear, layout: ShardLayout, rank: int, size: int) -> None:
    """Keep the input columns `layout` gives this rank; the bias is added on rank 0 only."""
    keep(lin, "weight", layout, rank, size, 1)
    if lin.bias is not None:
        zero_unless_rank0(lin, "bias", rank)
    lin.in_features = lin.weight.shape[1]


def rebuild_fused(module: nn.Module) -> None:
    for name, v in vars(module).items():  # fused views of the old weights: rebuild from the shards
        if isinstance(v, FusedLinear):
            setattr(module, name, FusedLinear(v.linears))


def sum_over_ranks(layer: nn.Module, all_reduce: Callable) -> None:
    """Make `layer` (a RowParallel layer: attention, MLP, MoE or mixer whose last projection is
    row-parallel) add its ranks' partial outputs: its forward ends with `rank_sum`."""
    if not isinstance(layer, RowParallel):
        raise TypeError(f"{type(layer).__name__} does not sum its output over ranks (not a RowParallel "
                        f"layer); a row-parallel cut of it would return a partial sum")
    layer.rank_sum = all_reduce
