"""The kinds of layer memory a model's layer specs make, each with its own pool, sized as given.

Attention layers form one group per window (None: full attention), each a `FullAttentionMemory`
or `SlidingWindowMemory`; the lead group (full attention, else the widest window) answers what
the KV as a whole knows. Recurrent layers share one `RecurrentMemory`, which asks the lead group
whether a checkpoint's block is still reachable and how many continuations it has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from hybridkv.errors import MemoryBudgetError
from hybridkv.plan import attention_groups, lead_group
from hybridkv.specs import AttentionSpec, LayerSpec

from .full_attention import FullAttentionMemory
from .host_kv_tier import HostKvTier
from .layer_memory import LayerMemory
from .recurrent import RecurrentMemory
from .sliding_window import SlidingWindowMemory


@dataclass
class ModelKinds:
    """attention_groups: {window: memory}, full attention first; attention: the lead group (None
    without attention layers); recurrent: None without recurrent layers; all: every kind, those
    that can refuse for lack of a slot first (the coordinator asks them in this order); host_kv:
    the host tier of evicted KV blocks (None without a host budget or attention layers)."""

    attention_groups: dict[Optional[int], FullAttentionMemory]
    attention: Optional[FullAttentionMemory]
    recurrent: Optional[RecurrentMemory]
    host_kv: Optional[HostKvTier] = None

    @property
    def all(self) -> list[LayerMemory]:
        return [k for k in (self.recurrent, *self.attention_groups.values()) if k is not None]


def make_kinds(specs: Mapping[int, LayerSpec], block_size: int, num_blocks: int | Mapping[Optional[int], int],
               num_slots: int, device: torch.device | str, checkpoint_eviction: str,
               flops_per_token: Optional[float], max_num_batched_tokens: Optional[int],
               draft_slots: int = 0, host_cache_bytes: int = 0) -> ModelKinds:
    """num_blocks: one count for every attention group, or {window: count}; num_slots: state slots
    including the null slot 0, `draft_slots` of them kept from checkpoints (speculative decoding);
    host_cache_bytes: the host tier's budget (0: none): evicted state checkpoints
    (memory/host_tier.py) and evicted KV blocks (memory/host_kv_tier.py) share it, states first.
    Raises MemoryBudgetError naming the pool that is too small."""
    if not specs:
        raise MemoryBudgetError("specs are empty: the model declares no attention and no recurrent layer")
    attn_layers = attention_groups(specs)  # raises TypeError on a spec of no kind
    recurrent_layers = {i: s for i, s in sorted(specs.items()) if RecurrentMemory.handles(s)}
    blocks = dict(num_blocks) if isinstance(num_blocks, Mapping) else {w: num_blocks for w in attn_layers}
    for w in attn_layers:
        n = blocks.get(w, 0)
        if not isinstance(n, int) or n < 1:
            group = "full-attention" if w is None else f"sliding-window {w}"
            raise MemoryBudgetError(
                f"num_blocks={n!r} for the {group} layers: a model with attention layers needs >= 1 KV "
                f"block per group (groups: {[('full' if k is None else k) for k in attn_layers]})")
    if recurrent_layers and num_slots < 2:
        raise MemoryBudgetError(
            f"num_slots={num_slots}: a model with recurrent layers needs >= 2 slots (null slot 0 + one live)")
    groups: dict[Optional[int], FullAttentionMemory] = {
        w: FullAttentionMemory(layers, block_size, blocks[w], device) if w is None else
        SlidingWindowMemory(layers, block_size, blocks[w], device, max_chunk_tokens=max_num_batched_tokens)
        for w, layers in attn_layers.items()}
    lead_window = lead_group(attn_layers) if attn_layers else None
    lead = groups[lead_window] if attn_layers else None
    host_kv = HostKvTier(groups, block_size, host_cache_bytes) if host_cache_bytes and groups else None
    # a state's prefix is reachable while its last block is on the device or in the host KV tier
    reachable = (lambda h: host_kv.reachable(lead_window, h)) if host_kv else lead.is_cached if lead else None
    recurrent = None
    if recurrent_layers:
        attn = [s for s in specs.values() if isinstance(s, AttentionSpec)]
        # Prefill FLOPs saved by a checkpoint at p: linear part plus attention's p^2 term.
        quad = 4.0 * sum(s.num_kv_heads * s.head_dim for s in attn)
        lin = float(flops_per_token) if flops_per_token else 0.0
        recurrent = RecurrentMemory(
            recurrent_layers, block_size, num_slots, device, eviction=checkpoint_eviction,
            saved_flops=lambda p: lin * p + quad * p * p + p,
            reachable=reachable or (lambda h: True),
            branches=lead.num_children if lead else (lambda h: 0), draft_reserve=draft_slots,
            host_cache_bytes=host_cache_bytes)
        if recurrent.host is not None and lead is not None:  # an output state's edge (memory/host_tier.py)
            recurrent.host.parent_of, recurrent.host.block_size = lead.parent_hash, block_size
            recurrent.host.on_device = recurrent.checkpoints.__contains__
        if host_kv is not None:  # one host budget: states and swaps first, KV in what they leave
            recurrent.host.kv = host_kv
            host_kv.held_elsewhere = lambda: recurrent.host.used_bytes + recurrent.host.swap_bytes
    return ModelKinds(groups, lead, recurrent, host_kv)
