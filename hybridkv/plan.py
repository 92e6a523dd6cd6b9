"""The memory plan: exact bytes per KV block and per state slot, and how many of each fit.

Each pool is sized exactly from the layer specs; neither kind is padded to the other's page size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hybridkv.errors import MemoryBudgetError
from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec


def split_specs(specs: Mapping[int, LayerSpec]) -> tuple[dict[int, AttentionSpec], dict[int, RecurrentSpec]]:
    """Split `{layer_idx: spec}` into (attention layers, recurrent layers), both keyed by layer index."""
    attn, rec = {}, {}
    for idx, spec in sorted(specs.items()):
        if isinstance(spec, AttentionSpec):
            attn[idx] = spec
        elif isinstance(spec, RecurrentSpec):
            rec[idx] = spec
        else:
            raise TypeError(f"layer {idx}: spec {spec!r} is neither AttentionSpec nor RecurrentSpec")
    return attn, rec


def kv_bytes_per_token(specs: Mapping[int, LayerSpec]) -> int:
    """Bytes of K and V that one token keeps across all attention layers."""
    return sum(s.bytes_per_token() for s in split_specs(specs)[0].values())


def kv_bytes_per_block(specs: Mapping[int, LayerSpec], block_size: int) -> int:
    """Bytes of one KV block (block_size tokens) across all attention layers."""
    _check_block_size(block_size)
    return block_size * kv_bytes_per_token(specs)


def state_bytes_per_slot(specs: Mapping[int, LayerSpec]) -> int:
    """Bytes of one state slot across all recurrent layers (conv + SSM/GDN state, each in its dtype)."""
    return sum(s.bytes_per_slot() for s in split_specs(specs)[1].values())


def kv_bytes_per_request(specs: Mapping[int, LayerSpec], context_len: int, block_size: int) -> int:
    """KV bytes one running request of `context_len` tokens holds in whole blocks: a full-attention
    layer keeps every block, a sliding-window layer at most ceil(window / block_size) + 1."""
    _check_block_size(block_size)
    total = 0
    for s in split_specs(specs)[0].values():
        blocks = -(-context_len // block_size)
        if s.sliding_window is not None:
            blocks = min(blocks, -(-s.sliding_window // block_size) + 1)
        total += blocks * block_size * s.bytes_per_token()
    return total


def kv_cache_bytes(specs: Mapping[int, LayerSpec], seq_len: int, batch_size: int) -> int:
    """KV bytes of `batch_size` sequences of `seq_len` tokens: 2 x L x kv_heads x head_dim x S x B x bytes."""
    return kv_bytes_per_token(specs) * seq_len * batch_size


@dataclass(frozen=True)
class MemoryPlan:
    """How a byte budget splits into KV blocks and state slots.

    num_slots counts the null slot 0; live_slots = max_num_seqs (or fewer if the budget is small);
    checkpoint_slots is the share reserved for prefix-cache checkpoints. Slots are one pool:
    the split only sizes it.
    """

    block_size: int
    kv_bytes_per_block: int
    state_bytes_per_slot: int
    num_blocks: int
    num_slots: int
    live_slots: int
    checkpoint_slots: int
    budget_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.state_bytes_per_slot

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes


def plan(
    specs: Mapping[int, LayerSpec],
    budget_bytes: int,
    block_size: int = 16,
    max_num_seqs: int = 256,
    checkpoint_share: float = 0.1,
) -> MemoryPlan:
    """Split `budget_bytes` into KV blocks and state slots.

    Recurrent models get 1 null slot, `min(max_num_seqs, what fits)` live slots (each running
    request needs one slot and at least one block) and `checkpoint_share x budget` worth of
    checkpoint slots; every byte left goes to KV blocks. Pure-attention models get no slots;
    pure-recurrent models get no blocks. Raises MemoryBudgetError when the budget cannot hold
    one block and one live slot (plus the null slot).
    """
    _check_block_size(block_size)
    if max_num_seqs < 1:
        raise MemoryBudgetError(f"max_num_seqs={max_num_seqs} must be >= 1")
    if not 0.0 <= checkpoint_share < 1.0:
        raise MemoryBudgetError(f"checkpoint_share={checkpoint_share} must be in [0, 1)")
    attn, rec = split_specs(specs)
    if not attn and not rec:
        raise MemoryBudgetError("specs are empty: the model declares no attention and no recurrent layer")
    block_bytes = kv_bytes_per_block(specs, block_size) if attn else 0
    slot_bytes = state_bytes_per_slot(specs) if rec else 0
    minimum = block_bytes + (2 * slot_bytes if rec else 0)
    if budget_bytes < minimum:
        raise MemoryBudgetError(
            f"memory budget of {budget_bytes} bytes cannot hold one KV block ({block_bytes} bytes) "
            f"and one live state slot plus the null slot ({2 * slot_bytes if rec else 0} bytes); "
            f"need at least {minimum} bytes: raise the budget or lower block_size"
        )
    if not rec:
        return MemoryPlan(block_size, block_bytes, 0, budget_bytes // block_bytes, 0, 0, 0, budget_bytes)
    ckpt_slots = int(budget_bytes * checkpoint_share) // slot_bytes
    rest = budget_bytes - (1 + ckpt_slots) * slot_bytes
    if rest < slot_bytes + block_bytes:  # checkpoints never squeeze out the first live request
        ckpt_slots, rest = 0, budget_bytes - slot_bytes
    live = min(max_num_seqs, rest // (slot_bytes + block_bytes))
    rest -= live * slot_bytes
    if not attn:  # no KV pool to feed: the remainder holds more checkpoints
        ckpt_slots += rest // slot_bytes
    num_blocks = rest // block_bytes if attn else 0
    return MemoryPlan(block_size, block_bytes, slot_bytes, num_blocks, 1 + live + ckpt_slots, live,
                      ckpt_slots, budget_bytes)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise MemoryBudgetError(f"block_size={block_size!r} must be a positive integer (e.g. 16)")
