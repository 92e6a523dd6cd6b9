"""A layer that ends in a row-parallel projection under tensor parallelism.

Cut over ranks (hybridkv/parallel/sharding.py), such a layer's last projection keeps only its
rank's input columns, so each rank's output is a partial sum. The layer itself adds the parts:
its forward ends with `self.rank_sum(out)`, which is the identity on one rank and the group's
all-reduce once the layer is sharded. No hook and no class swap: reading the forward shows the
sum, and a caller that runs the layer any way gets the whole output.
"""
from __future__ import annotations

import torch


class RowParallel:
    """Mixed into a layer (before nn.Module) whose output is summed over tensor-parallel ranks.
    `rank_sum(t) -> t` adds the ranks' parts of `t` (any shape); sharding sets it per instance."""

    @staticmethod
    def rank_sum(t: torch.Tensor) -> torch.Tensor:
        return t  # one rank: the output is already whole
