"""The memory plan: exact bytes per KV block and per state slot, and how many of each fit.

Each pool is sized exactly from the layer specs; neither kind is padded to the other's page size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

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


def attention_groups(specs: Mapping[int, LayerSpec]) -> dict[Optional[int], dict[int, AttentionSpec]]:
    """{window (None: full attention): {layer: spec}}: the attention layers that share one block
    pool and one block table; full attention first, then windows from the smallest."""
    attn = split_specs(specs)[0]
    keys = sorted({s.sliding_window for s in attn.values()}, key=lambda w: (w is not None, w or 0))
    return {w: {i: s for i, s in attn.items() if s.sliding_window == w} for w in keys}


def lead_group(windows) -> Optional[int]:
    """The group whose pool grows with the context: full attention if any, else the widest window."""
    windows = list(windows)
    return None if None in windows else max(windows)


def sliding_blocks_to_hold(window: int, block_size: int, max_chunk_tokens: Optional[int]) -> Optional[int]:
    """The most blocks one request holds in a window's pool whatever its length (a prefill chunk
    of C tokens needs the window before it plus its own blocks); None when chunks are unbounded."""
    if max_chunk_tokens is None:
        return None
    return -(-(window - 1 + max_chunk_tokens) // block_size) + 1


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
    checkpoint_slots is the share reserved for prefix-cache checkpoints; draft_slots the slots kept
    free for speculative decoding's per-position states (checkpoints never take them). Slots are
    one pool: the split only sizes it.
    """

    block_size: int
    kv_bytes_per_block: int
    state_bytes_per_slot: int
    num_blocks: int
    num_slots: int
    live_slots: int
    checkpoint_slots: int
    budget_bytes: int
    draft_slots: int = 0
    # {window (None: full): blocks} when attention layers form several groups (full and windows);
    # num_blocks is then the lead group's (lead_group()). Empty with one group.
    group_blocks: Mapping[Optional[int], int] = field(default_factory=dict)
    group_bytes_per_block: Mapping[Optional[int], int] = field(default_factory=dict)

    @property
    def kv_bytes(self) -> int:
        if self.group_blocks:
            return sum(n * self.group_bytes_per_block[w] for w, n in self.group_blocks.items())
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
    max_chunk_tokens: Optional[int] = None,
    draft_slots: int = 0,
) -> MemoryPlan:
    """Split `budget_bytes` into KV blocks and state slots.

    Recurrent models get 1 null slot, `min(max_num_seqs, what fits)` live slots (each running
    request needs one slot and at least one block) and `checkpoint_share x budget` worth of
    checkpoint slots, and `draft_slots` more (speculative decoding) when at least one live slot
    and block still fit; every byte left goes to KV blocks. Pure-attention models get no slots;
    pure-recurrent models get no blocks. Raises MemoryBudgetError when the budget cannot hold
    one block and one live slot (plus the null slot).

    Attention layers with different windows (full and sliding, or two windows) form groups, each
    with its own pool (attention_groups()). The KV bytes are split so that every group has as many
    blocks as the lead group (full attention), except that a sliding group never gets more than
    its requests can hold at once: seqs x sliding_blocks_to_hold(window, block_size,
    max_chunk_tokens) (seqs: the live slots, or max_num_seqs without recurrent layers). The
    bytes a cap saves go to the groups that grow with the context.
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
        groups, lead = _split_kv(specs, budget_bytes, block_size, max_num_seqs, max_chunk_tokens)
        return MemoryPlan(block_size, block_bytes, 0, lead, 0, 0, 0, budget_bytes, 0, *groups)
    ckpt_slots = int(budget_bytes * checkpoint_share) // slot_bytes
    rest = budget_bytes - (1 + ckpt_slots) * slot_bytes
    if rest < slot_bytes + block_bytes:  # checkpoints never squeeze out the first live request
        ckpt_slots, rest = 0, budget_bytes - slot_bytes
    if draft_slots and rest - draft_slots * slot_bytes < slot_bytes + block_bytes:
        draft_slots = 0  # neither do draft slots: speculation then finds none and stays off
    rest -= draft_slots * slot_bytes
    live = min(max_num_seqs, rest // (slot_bytes + block_bytes))
    rest -= live * slot_bytes
    if not attn:  # no KV pool to feed: the remainder holds more checkpoints
        ckpt_slots += rest // slot_bytes
    groups, num_blocks = _split_kv(specs, rest, block_size, live, max_chunk_tokens) if attn else (({}, {}), 0)
    return MemoryPlan(block_size, block_bytes, slot_bytes, num_blocks, 1 + live + ckpt_slots + draft_slots, live,
                      ckpt_slots, budget_bytes, draft_slots, *groups)


def _split_kv(specs, kv_budget: int, block_size: int, seqs: int, max_chunk_tokens: Optional[int]):
    """((group blocks, group bytes per block) — both empty for one group —, lead group's blocks)."""
    groups = attention_groups(specs)
    per_block = {w: block_size * sum(s.bytes_per_token() for s in g.values()) for w, g in groups.items()}
    if len(groups) == 1:
        return ({}, {}), kv_budget // next(iter(per_block.values()))
    lead = lead_group(groups)
    caps = {w: seqs * h for w in groups if w != lead
            for h in [sliding_blocks_to_hold(w, block_size, max_chunk_tokens)] if h is not None}
    capped: dict[Optional[int], int] = {}
    while True:  # every uncapped group gets n blocks; a group whose cap is below n gets its cap
        left = kv_budget - sum(n * per_block[w] for w, n in capped.items())
        n = left // sum(b for w, b in per_block.items() if w not in capped)
        over = {w: c for w, c in caps.items() if w not in capped and c < n}
        if not over:
            break
        capped.update(over)
    blocks = {w: capped.get(w, n) for w in groups}
    return (blocks, per_block), blocks[lead]


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise MemoryBudgetError(f"block_size={block_size!r} must be a positive integer (e.g. 16)")
