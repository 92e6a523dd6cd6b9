"""The data moves of rank 0's pools that every other rank repeats on its shard, and the reads it answers.

Rank 0's memory manager decides every pool move; its pools' mirrors (pool_mirror.py) record each
one as a move below, in order, and the executor sends them with the next step (a read goes at
once, after the moves before it). Writes carry FULL tensors (the one-device layout of a swap-in
or an import); each rank keeps its own heads / channels of them. Reads answer with this rank's
shard, which rank 0 merges. `ShardedPools` is a rank's own pools: the shard's shapes, rank 0's
block and slot counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping

import torch

from hybridkv.block_pool import BlockPool
from hybridkv.layer_loads import LayerLoads
from hybridkv.specs import LayerSpec, RecurrentSpec
from hybridkv.state_pool import StatePool

KV_DIM, STATE_DIM = 3, 0  # the head dimension of [n, parts, block_size, heads, head_dim]; of a slot


@dataclass(frozen=True)
class PoolPlan:
    """What the other ranks need to build rank 0's pools in their shard's shapes."""

    blocks: dict  # attention group key (its window; None: full attention) -> (its layer indices, blocks)
    slots: int
    block_size: int


class ShardedPools:
    """A rank's own pools (shard shapes, sized by rank 0's plan), and its cut of full tensors.

    layouts: {cache layer: CacheShard}, how each layer's pool tensors are cut."""

    def __init__(self, specs: Mapping[int, LayerSpec], layouts: dict, rank: int, size: int, plan: PoolPlan,
                 device: torch.device):
        self.rank, self.size, self.layouts = rank, size, layouts
        self.block_size = plan.block_size
        self.blocks = {key: BlockPool({i: specs[i] for i in layers}, n, self.block_size, device)
                       for key, (layers, n) in plan.blocks.items()}
        rec = {i: s for i, s in specs.items() if isinstance(s, RecurrentSpec)}
        self.states = StatePool(rec, plan.slots, device)
        self.loads = LayerLoads(device)  # one for all this rank's pools (hybridkv/layer_loads.py)
        for pool in [*self.blocks.values(), self.states]:
            pool.loads = self.loads

    @property
    def kv(self) -> dict[int, torch.Tensor]:
        return {i: t for pool in self.blocks.values() for i, t in pool.kv.items()}

    def kv_shard(self, full: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{layer: [n, parts, block_size, all heads, head_dim]} -> this rank's heads."""
        return {i: self.layouts[i].kv.take(t, self.rank, self.size, KV_DIM) for i, t in full.items()}

    def slot_shard(self, conv: Mapping[int, torch.Tensor], ssm: Mapping[int, torch.Tensor]) -> tuple[dict, dict]:
        """One slot's full conv and SSM tensors -> this rank's channels of each."""
        return ({i: self.layouts[i].conv.take(t, self.rank, self.size, STATE_DIM) for i, t in conv.items()},
                {i: self.layouts[i].state.take(t, self.rank, self.size, STATE_DIM) for i, t in ssm.items()})


# ---- moves (writes): applied in order, no answer ----------------------------------------------
@dataclass(frozen=True)
class CopyBlock:
    """Copy-on-write of a shared partial block in attention group `key`."""

    key: Hashable
    src: int
    dst: int

    def apply(self, pools: ShardedPools) -> None:
        pools.blocks[self.key].copy_block(self.src, self.dst)


@dataclass(frozen=True)
class ScatterBlocks:
    """A swap-in or an import into `blocks`: full {layer: [len(blocks), parts, bs, heads, d]} (CPU)."""

    key: Hashable
    blocks: list
    full: dict

    def apply(self, pools: ShardedPools) -> None:
        pools.blocks[self.key].scatter(self.blocks, pools.kv_shard(self.full))


@dataclass(frozen=True)
class CopySlot:
    """A state copy: checkpoint, copy-on-hit or fork."""

    src: int
    dst: int

    def apply(self, pools: ShardedPools) -> None:
        pools.states.copy(self.src, self.dst)


@dataclass(frozen=True)
class WriteSlot:
    """A swap-in or an import of one slot: full conv and SSM tensors per layer (CPU)."""

    slot: int
    conv: dict
    ssm: dict

    def apply(self, pools: ShardedPools) -> None:
        pools.states.from_host(self.slot, *pools.slot_shard(self.conv, self.ssm))


# ---- reads: answered with this rank's shard ---------------------------------------------------
@dataclass(frozen=True)
class ReadBlocks:
    """A swap-out or an export: this rank's {layer: [len(blocks), parts, bs, its heads, d]} (CPU)."""

    key: Hashable
    blocks: list

    def apply(self, pools: ShardedPools) -> dict:
        return pools.blocks[self.key].gather(self.blocks, "cpu")


@dataclass(frozen=True)
class ReadSlot:
    """A swap-out or an export of one slot: this rank's (conv, ssm) per layer (CPU)."""

    slot: int

    def apply(self, pools: ShardedPools) -> tuple[dict, dict]:
        return pools.states.to_host(self.slot, "cpu")


READS = (ReadBlocks, ReadSlot)
