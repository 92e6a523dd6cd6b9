"""Rank 0's pools speak for every rank's: each pool's mirror records its data moves for the others.

The memory manager's bookkeeping (refcounts, hashes, slot kinds) lives on rank 0 only; its pool
tensors hold rank 0's shard. A `BlockPool` / `StatePool` tells its `mirror` (set once, before
any request, by `mirror_pools`) of every data move it makes: a copy-on-write of a block, a state
copy for a checkpoint or a fork, a write (swap-in, import), a read (swap-out, export). Copies and
writes become moves (pool_moves.py) that wait in `RankMoves` until the executor sends them with
the next step; a read sends them at once and returns FULL tensors (every rank's shard merged),
and a write takes full tensors (rank 0 keeps its shard, the move carries the rest). So swapped
copies and snapshots look as on one device: a snapshot of a TP=2 engine imports into a TP=1
engine and back. For the same reason the kinds' `layers` (what check_import and layer_shapes
speak of) are set to the full specs, while the pools keep the shard's.
"""
from __future__ import annotations

from typing import Hashable, Mapping

import torch

from hybridkv.specs import LayerSpec

from .pool_moves import KV_DIM, STATE_DIM, CopyBlock, CopySlot, PoolPlan, ReadBlocks, ReadSlot, ScatterBlocks, WriteSlot


class RankMoves:
    """Rank 0's pool moves not yet sent to ranks 1..N-1, in the order they were made.

    ranks: has `ask(items) -> [answer of rank 1, ...]` (tensor_parallel.py)."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.pending: list = []

    def add(self, move) -> None:
        self.pending.append(move)

    def take(self) -> list:
        """The pending moves, oldest first; none are pending after."""
        moves, self.pending = self.pending, []
        return moves

    def read(self, read) -> list:
        """Send the pending moves, then `read`; returns ranks 1..N-1's answers to it, rank order."""
        return self.ranks.ask(self.take() + [read])


class BlockPoolMirror:
    """The mirror of rank 0's BlockPool of attention group `key` (its window; None: full attention).

    layouts: {layer: ShardLayout of its KV heads}; size: the number of ranks."""

    def __init__(self, key: Hashable, layouts: dict, moves: RankMoves, size: int):
        self.key, self.layouts, self.moves, self.size = key, layouts, moves, size

    def copied(self, src: int, dst: int) -> None:
        self.moves.add(CopyBlock(self.key, src, dst))

    def gathered(self, blocks: list[int], mine: dict, device, pin: bool) -> dict[int, torch.Tensor]:
        """mine: rank 0's {layer: [n, parts, bs, its heads, d]} on the CPU -> every head's, on `device`."""
        shards = [mine] + self.moves.read(ReadBlocks(self.key, list(blocks)))
        out = {}
        for i, layout in self.layouts.items():
            full = layout.merge([s[i] for s in shards], KV_DIM)
            out[i] = full.pin_memory() if pin else full.to(device)
        return out

    def scattered(self, blocks: list[int], data: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """data: every head's {layer: [n, parts, bs, heads, d]} -> rank 0's heads (the move carries all)."""
        full = {i: t.cpu() for i, t in data.items()}
        self.moves.add(ScatterBlocks(self.key, list(blocks), full))
        return {i: self.layouts[i].take(t, 0, self.size, KV_DIM) for i, t in full.items()}


class StatePoolMirror:
    """The mirror of rank 0's StatePool. layouts: {recurrent layer: CacheShard (conv, state)}."""

    def __init__(self, layouts: dict, moves: RankMoves, size: int):
        self.layouts, self.moves, self.size = layouts, moves, size

    def copied(self, src: int, dst: int) -> None:
        self.moves.add(CopySlot(src, dst))

    def gathered(self, slot: int, mine: tuple[dict, dict], device, pin: bool) -> tuple[dict, dict]:
        """mine: rank 0's (conv, ssm) of `slot` on the CPU -> every channel's, on `device`."""
        shards = [mine] + self.moves.read(ReadSlot(slot))
        out = []
        for part, tensors in enumerate(mine):
            merged = {}
            for i in tensors:
                layout = self.layouts[i].conv if part == 0 else self.layouts[i].state
                full = layout.merge([s[part][i] for s in shards], STATE_DIM)
                merged[i] = full.pin_memory() if pin else full.to(device)
            out.append(merged)
        return out[0], out[1]

    def scattered(self, slot: int, conv: Mapping[int, torch.Tensor], ssm: Mapping[int, torch.Tensor],
                  layers: tuple) -> tuple[dict, dict]:
        """Full conv and SSM tensors of `slot` -> rank 0's channels (the move carries all).
        layers: (the pool's conv layers, its SSM layers): only those are written."""
        conv = {i: conv[i].cpu() for i in layers[0]}
        ssm = {i: ssm[i].cpu() for i in layers[1]}
        self.moves.add(WriteSlot(slot, conv, ssm))
        return ({i: self.layouts[i].conv.take(t, 0, self.size, STATE_DIM) for i, t in conv.items()},
                {i: self.layouts[i].state.take(t, 0, self.size, STATE_DIM) for i, t in ssm.items()})


def attention_memories(manager) -> dict:
    """{group key: attention memory}: one per window group when the manager has groups."""
    groups = getattr(manager, "attention_groups", None)
    if groups is None:
        groups = {None: manager.attention} if manager.attention is not None else {}
    return dict(groups)


def pool_plan(manager) -> PoolPlan:
    """The block count of every attention group's pool, the slot count and the block size."""
    return PoolPlan({k: (sorted(m.layers), m.pool.num_blocks) for k, m in attention_memories(manager).items()},
                    manager.recurrent.states.num_slots if manager.recurrent else 0, manager.block_size)


def mirror_pools(manager, moves: RankMoves, layouts: dict, full_specs: Mapping[int, LayerSpec], size: int) -> None:
    """Give each of rank 0's pools its mirror (before any request: no move is missed) and the
    kinds their full specs. layouts: {cache layer: CacheShard}."""
    for key, memory in attention_memories(manager).items():
        memory.pool.mirror = BlockPoolMirror(key, {i: layouts[i].kv for i in memory.pool.kv}, moves, size)
        memory.layers = {i: full_specs[i] for i in memory.layers}
    if manager.recurrent is not None:
        rec = manager.recurrent
        rec.states.mirror = StatePoolMirror({i: layouts[i] for i in rec.layers}, moves, size)
        rec.layers = {i: full_specs[i] for i in rec.layers}
