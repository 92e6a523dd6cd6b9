"""Rank 0's pools stand for every rank's: data moves are journaled for the other ranks, reads gathered.

The memory manager's bookkeeping (refcounts, hashes, slot kinds) lives on rank 0 only. Its pool
tensors hold rank 0's shard; every data move it makes (copy-on-write of a block, a state copy for
a checkpoint or a fork, a swap, an import) is appended to a journal that the other ranks apply,
in order, before the next forward. A read (swap-out, export) gathers every rank's shard and
returns FULL tensors, and a write (swap-in, import) takes full tensors and scatters the shards, so
swapped copies and snapshots look as on one device: a snapshot of a TP=2 engine imports into a
TP=1 engine and back. For the same reason the kinds' `layers` (what check_import and
layer_shapes speak of) are set to the full specs, while the pools keep the shard's.

`ShardedPools` is the other ranks' side: plain pools of their shard plus `apply(op)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from hybridkv.block_pool import BlockPool
from hybridkv.specs import LayerSpec, RecurrentSpec
from hybridkv.state_pool import StatePool

from .group import TensorParallelGroup

KV_DIM, STATE_DIM = 3, 0  # the head dimension of [n, parts, block_size, heads, head_dim]; of a slot


class Journal:
    """Rank 0's pending data moves; `flush` sends them (with a forward or a read) to every rank."""

    def __init__(self, group: TensorParallelGroup, send):
        self.group, self.send = group, send
        self.ops: list[tuple] = []

    def add(self, op: tuple) -> None:
        self.ops.append(op)

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def ask(self, op: tuple) -> list:
        """Flush with `op` (a read) appended; returns ranks 1..N-1's answers to it."""
        self.send(self.take() + [op])
        return self.group.gather_objects(None)[1:]


class MirroredBlockPool(BlockPool):
    """A BlockPool whose data moves reach every rank (set up by `mirror_pools`)."""

    journal: Journal
    layouts: dict
    key: object  # which attention group's pool (its window; None: full attention)

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self.journal.add(("copy_block", self.key, src, dst))

    def gather(self, blocks: list[int], device="cpu", pin: bool = False) -> dict[int, torch.Tensor]:
        mine = super().gather(blocks, "cpu")
        shards = [mine] + self.journal.ask(("gather_blocks", self.key, list(blocks)))
        out = {}
        for i, layout in self.layouts.items():
            full = layout.merge([s[i] for s in shards], KV_DIM)
            out[i] = full.pin_memory() if pin else full.to(device)
        return out

    def scatter(self, blocks: list[int], data: Mapping[int, torch.Tensor]) -> None:
        full = {i: t.cpu() for i, t in data.items()}
        self.journal.add(("scatter_blocks", self.key, list(blocks), full))
        super().scatter(blocks, {i: self.layouts[i].take(t, 0, self.journal.group.size, KV_DIM)
                                 for i, t in full.items()})


class MirroredStatePool(StatePool):
    """A StatePool whose data moves reach every rank (set up by `mirror_pools`)."""

    journal: Journal
    layouts: dict  # layer -> CacheShard (conv, state)

    def copy(self, src: int, dst: int) -> None:
        super().copy(src, dst)
        self.journal.add(("copy_slot", src, dst))

    def to_host(self, slot: int, device="cpu", pin: bool = False) -> tuple[dict, dict]:
        mine = super().to_host(slot, "cpu")
        shards = [mine] + self.journal.ask(("slot_to_host", slot))
        out = []
        for part, tensors in enumerate(mine):
            merged = {}
            for i in tensors:
                layout = self.layouts[i].conv if part == 0 else self.layouts[i].state
                full = layout.merge([s[part][i] for s in shards], STATE_DIM)
                merged[i] = full.pin_memory() if pin else full.to(device)
            out.append(merged)
        return out[0], out[1]

    def from_host(self, slot: int, conv: Mapping[int, torch.Tensor], ssm: Mapping[int, torch.Tensor]) -> None:
        conv = {i: conv[i].cpu() for i in self.conv}
        ssm = {i: ssm[i].cpu() for i in self.ssm}
        self.journal.add(("slot_from_host", slot, conv, ssm))
        size = self.journal.group.size
        super().from_host(slot, {i: self.layouts[i].conv.take(t, 0, size, STATE_DIM) for i, t in conv.items()},
                          {i: self.layouts[i].state.take(t, 0, size, STATE_DIM) for i, t in ssm.items()})


def attention_memories(manager) -> dict:
    """{group key: attention memory}: one per window group when the manager has groups."""
    groups = getattr(manager, "attention_groups", None)
    if groups is None:
        groups = {None: manager.attention} if manager.attention is not None else {}
    return dict(groups)


@dataclass(frozen=True)
class PoolPlan:
    """What the other ranks need to build rank 0's pools in their shard's shapes."""

    blocks: dict  # attention group key -> (its layer indices, number of blocks)
    slots: int
    block_size: int


def pool_plan(manager) -> PoolPlan:
    return PoolPlan({k: (sorted(m.layers), m.pool.num_blocks) for k, m in attention_memories(manager).items()},
                    manager.recurrent.states.num_slots if manager.recurrent else 0, manager.block_size)


def mirror_pools(manager, journal: Journal, layouts: dict, full_specs: Mapping[int, LayerSpec]) -> None:
    """Turn rank 0's manager's pools into mirrored ones (same objects, same bookkeeping)."""
    for key, memory in attention_memories(manager).items():
        pool = memory.pool
        pool.__class__ = MirroredBlockPool
        pool.journal, pool.key, pool.layouts = journal, key, {i: layouts[i].kv for i in pool.kv}
        memory.layers = {i: full_specs[i] for i in memory.layers}
    if manager.recurrent is not None:
        states = manager.recurrent.states
        states.__class__ = MirroredStatePool
        states.journal, states.layouts = journal, {i: layouts[i] for i in manager.recurrent.layers}
        manager.recurrent.layers = {i: full_specs[i] for i in manager.recurrent.layers}


class ShardedPools:
    """A rank's own pools (shard shapes, sized by rank 0's plan) and the data moves it applies."""

    def __init__(self, specs: Mapping[int, LayerSpec], layouts: dict, rank: int, size: int, plan: PoolPlan,
                 device: torch.device):
        self.rank, self.size, self.layouts = rank, size, layouts
        self.block_size = plan.block_size
        self.blocks = {key: BlockPool({i: specs[i] for i in layers}, n, self.block_size, device)
                       for key, (layers, n) in plan.blocks.items()}
        rec = {i: s for i, s in specs.items() if isinstance(s, RecurrentSpec)}
        self.states = StatePool(rec, plan.slots, device)

    @property
    def kv(self) -> dict[int, torch.Tensor]:
        return {i: t for pool in self.blocks.values() for i, t in pool.kv.items()}

    def apply(self, op: tuple) -> Optional[object]:
        """Apply one journaled move; returns this rank's answer to a read (else None)."""
        kind, *args = op
        if kind == "copy_block":
            key, src, dst = args
            self.blocks[key].copy_block(src, dst)
        elif kind == "gather_blocks":
            key, blocks = args
            return self.blocks[key].gather(blocks, "cpu")
        elif kind == "scatter_blocks":
            key, blocks, full = args
            self.blocks[key].scatter(blocks, {i: self.layouts[i].kv.take(t, self.rank, self.size, KV_DIM)
                                         for i, t in full.items()})
        elif kind == "copy_slot":
            self.states.copy(*args)
        elif kind == "slot_to_host":
            return self.states.to_host(args[0], "cpu")
        elif kind == "slot_from_host":
            slot, conv, ssm = args
            self.states.from_host(
                slot, {i: self.layouts[i].conv.take(t, self.rank, self.size, STATE_DIM) for i, t in conv.items()},
                {i: self.layouts[i].state.take(t, self.rank, self.size, STATE_DIM) for i, t in ssm.items()})
        else:
            raise ValueError(f"unknown pool operation {kind!r}")
        return None
