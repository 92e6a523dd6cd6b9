"""The packed, padding-free batch a model runs: prefill chunks and decodes mixed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class ForwardBatch:
    """One engine step's inputs, T tokens over R requests, requests in order.

    input_ids:        [T] long, the tokens of this step, request after request
    positions:        [T] long, absolute position of each token in its sequence
    query_start_loc:  [R+1] int32, request r's tokens are input_ids[qsl[r]:qsl[r+1]]
    seq_lens:         [R] int32, tokens in the sequence after this step (context + new)
    block_table:      [R, max_blocks] int32, KV block ids (unused entries may hold anything)
    slot_mapping:     [T] long, KV write slot `block * block_size + pos % block_size`, -1 skips
    state_slots:      [R] int32, the request's live slot in every recurrent layer's pool (for a
                      request in verify_slots: its chain's first slot, the state its run starts from)
    has_initial_state:[R] bool, False when the request starts from position 0 (state is zero)
    return_all_logits: logits for every token instead of the last of each request
    logits_indices:   [N] long, when set: the tokens whose logits come back, in this order
                      (the engine's prompt logprobs; overrides both rules above)
    kv_groups:        {window (None: full attention): KVGroupTables} when the model's attention
                      layers form several groups (full and sliding, or two windows), each with its
                      own pool; an attention layer then reads its group's table and slots
                      (kv_tables()). Empty: block_table and slot_mapping serve every layer.
    verify_slots:     {request index: [live slot, then a state slot per token]} of the requests
                      that verify a draft (speculative decoding): their recurrent layers read the
                      first slot, leave the state after each token in that token's slot and never
                      write the first one (slot_split.py; token_shift.py). The first slot is the
                      live one, except in a draft model's later rounds (speculative/draft_model.py),
                      which continue from a draft slot. Empty: none verifies.
    requantize:       None, or under a quantized state cache dtype `requantize(pool, slots)` -> the
                      rows `pool[slots]` as the pool would keep them (scheduler/cache_staging.py):
                      a verified draft token's state passes through it before the next token's
                      decode reads it, as a plain decode's state passes through the pool.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    return_all_logits: bool = False
    logits_indices: Optional[torch.Tensor] = None
    # Host-side copies so layers can split/loop without a device sync.
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    kernel_plans: dict = field(default_factory=dict, repr=False, compare=False)
    kv_groups: dict = field(default_factory=dict)
    verify_slots: dict = field(default_factory=dict)
    requantize: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def kv_tables(self, window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(block_table [R, W], slot_mapping [T], kernel plan dict) for attention layers of this
        window (None: full); each group keeps its own kernel plans (its slots and tables differ)."""
        if not self.kv_groups:
            return self.block_table, self.slot_mapping, self.kernel_plans
        group = self.kv_groups.get(window)
        if group is None:
            raise KeyError(f"no KV group for window {window!r} in this batch; groups: {sorted(self.kv_groups, key=str)}")
        return group.block_table, group.slot_mapping, self.kernel_plans.setdefault(("kv_group", window), {})

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return int(self.query_start_loc.shape[0]) - 1


@dataclass
class KVGroupTables:
    """One attention group's view of a step: block_table [R, W] int32 into the group's own pool,
    slot_mapping [T] long (`block * block_size + pos % block_size`)."""

    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    @staticmethod
    def from_table(table: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int) -> "KVGroupTables":
        """The slot mapping derived from a block table: table [R, W], positions [T], qsl [R+1]."""
        counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(table.shape[0], device=table.device), counts)
        slots = table[rows, positions // block_size].long() * block_size + positions % block_size
        return KVGroupTables(table, slots)


@dataclass
class ModelCaches:
    """The pools' tensors a model reads and writes, keyed by the model's layer index.

    kv[i]:    [num_blocks, 2, block_size, kv_heads, head_dim] for attention layer i
    conv[i]:  [num_slots, *RecurrentSpec.conv_shape] for recurrent layer i
    state[i]: [num_slots, *RecurrentSpec.state_shape] for recurrent layer i
    Slot 0 is the null slot.
    """

    kv: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    state: dict[int, torch.Tensor]
    block_size: int
    # Under a quantized KV cache dtype, in a step of one-token decodes (scheduler/cache_staging.py):
    # kv_codes(i) -> QuantizedPages of layer i, for a layer that reads codes in place instead of
    # kv[i] (PagedAttention.forward_codes), or None (then kv[i]).
    kv_codes: Optional[Callable[[int], Optional["QuantizedPages"]]] = None
    # Likewise under a quantized state cache dtype: state_codes(i) -> QuantizedState of layer i, for
    # a mixer that updates its slots' codes in place (Mamba2Mixer.forward_codes), or None.
    state_codes: Optional[Callable[[int], Optional["QuantizedState"]]] = None


@dataclass
class QuantizedPages:
    """One attention layer's quantized pool as its codes, for a step of one-token decodes: pool
    [num_blocks, 2, block_size, Hkv, nbytes] uint8 with `layout` (hybridkv.cache_dtype.QuantLayout
    of one head's vector), and the layer's block_table [R, W] and slot_mapping [T] (every slot >= 0)
    into that pool (the step's own, not the staging's renumbered ones)."""

    pool: torch.Tensor
    layout: object
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class QuantizedState:
    """One recurrent layer's quantized pools as codes, for a step of one-token decodes: conv [S,
    conv nbytes] and state [S, state nbytes] uint8 with their layouts (hybridkv.cache_dtype), and
    the step's own state slots [R] (pool slot ids, not the staging's renumbered ones)."""

    conv: torch.Tensor
    conv_layout: object
    state: torch.Tensor
    state_layout: object
    slots: torch.Tensor
