"""Which part of a full dimension each tensor-parallel rank holds, for weights and for states.

A dimension is a concatenation of segments (Mamba2's conv channels: x | B | C). A segment of
`count` units of `unit` elements is cut into `chunks` equal pieces; rank r holds piece
r * chunks // size of every segment, concatenated in order. chunks == size splits a segment
across ranks; chunks < size replicates each piece on size / chunks ranks (KV heads fewer than
ranks, one Mamba2 group). The same layout cuts a weight (`take`) and puts a state's shards
back together (`merge`), so swaps and snapshots move full tensors whatever the rank count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Segment:
    count: int   # units in the full segment (heads, groups, channels)
    chunks: int  # distinct pieces across ranks (size: split, fewer: replicated)
    unit: int = 1  # elements per unit (head_dim rows per head, ...)


@dataclass(frozen=True)
class ShardLayout:
    """segments along one dimension; `index(rank, size)` -> the full positions rank holds."""

    segments: tuple[Segment, ...]

    @staticmethod
    def of(*segments: tuple) -> "ShardLayout":
        return ShardLayout(tuple(Segment(*s) for s in segments))

    @property
    def full(self) -> int:
        return sum(s.count * s.unit for s in self.segments)

    def index(self, rank: int, size: int) -> torch.Tensor:
        """long [local]: positions in the full dimension that `rank` of `size` holds, in order."""
        out, at = [], 0
        for s in self.segments:
            per = s.count // s.chunks
            piece = rank * s.chunks // size
            lo = at + piece * per * s.unit
            out.append(torch.arange(lo, lo + per * s.unit))
            at += s.count * s.unit
        return torch.cat(out)

    def take(self, full: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
        """full [..., self.full at dim, ...] -> rank's shard (contiguous)."""
        return full.index_select(dim, self.index(rank, size).to(full.device)).contiguous()

    def merge(self, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every rank's shard (rank order) -> the full tensor; replicated pieces agree, any is kept."""
        first = shards[0]
        shape = list(first.shape)
        shape[dim] = self.full
        out = first.new_empty(shape)
        for r, t in enumerate(shards):
            out.index_copy_(dim, self.index(r, len(shards)).to(out.device), t.to(out.device))
        return out


@dataclass(frozen=True)
class CacheShard:
    """How one cache layer's pool tensors are cut: `kv` over the heads of an attention layer's
    blocks; `conv` over a recurrent layer's conv channels and `state` over its SSM state's
    leading (head) dimension."""

    kv: Optional[ShardLayout] = None
    conv: Optional[ShardLayout] = None
    state: Optional[ShardLayout] = None


def split_count(what: str, count: int, size: int, replicate: bool = False) -> int:
    """Pieces to cut `count` units into over `size` ranks: size when it divides count; with
    `replicate`, count when count divides size (each piece on several ranks). Else ValueError
    naming the value and tensor_parallel_size."""
    if count % size == 0:
        return size
    if replicate and size % count == 0:
        return count
    raise ValueError(f"{what}={count} cannot be split over tensor_parallel_size={size}: it must be a "
                     f"multiple of it{' (or divide it)' if replicate else ''}; choose a "
                     f"tensor_parallel_size that divides {count}")
