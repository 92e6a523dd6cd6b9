"""Prefix cache over both pools: chained block hashes find KV blocks, checkpoints hold states.

`h_i = sha256(h_{i-1} | extra key | tokens of block i)`; the extra key folds in the model
fingerprint, adapter id, multimodal hashes and the tenant's cache_salt, so tenants never share
(nor detect) each other's prefixes. A state checkpoint at `p = m x block_size` is keyed by
`h_{m-1}`. A checkpoint whose block left the KV cache is unreachable and is reclaimed first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from hybridkv.block_pool import BlockPool
from hybridkv.eviction import check_rule, choose_victim
from hybridkv.state_pool import CHECKPOINT, StatePool

MISS_NO_KV = "no_kv_match"
MISS_NO_CHECKPOINT = "kv_match_no_checkpoint"
MISS_CACHING_OFF = "caching_off"


@dataclass
class Checkpoint:
    slot: int
    position: int
    last_used: int
    output: bool = False  # a state inside a request's generated tokens (see store)


@dataclass
class PrefixMatch:
    """Result of a lookup. hit_tokens: usable prefix (blocks AND, for recurrent models, a checkpoint);
    blocks: the KV blocks of [0, hit_tokens); checkpoint: the state at hit_tokens, or None;
    kv_match_tokens: how far the KV blocks alone matched; miss: reason when hit_tokens == 0;
    branches: a cached block continues the KV match with other content (a shared-prefix junction)."""

    hit_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    checkpoint: Optional[Checkpoint] = None
    kv_match_tokens: int = 0
    miss: Optional[str] = None
    branches: bool = False


def extra_key(fingerprint: str, adapter_id=None, mm_hashes: Sequence[str] = (), cache_salt=None) -> bytes:
    """Digest of everything besides token ids that changes KV values, mixed into every block hash."""
    return hashlib.sha256(repr((fingerprint, adapter_id, tuple(mm_hashes), cache_salt)).encode()).digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], num_blocks: int, extra: bytes,
                  block_size: int) -> None:
    """Append chained hashes to `hashes` until it covers `num_blocks` full blocks of `token_ids`."""
    prev = hashes[-1] if hashes else b""
    for i in range(len(hashes), num_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        prev = hashlib.sha256(prev + extra + block).digest()
        hashes.append(prev)


class PrefixCache:
    """Matches prompts against the block pool's hash map and owns the checkpoint slots."""

    def __init__(self, blocks: BlockPool, states: StatePool, block_size: int, *, has_attention: bool,
                 has_recurrent: bool, eviction: str = "lru",
                 saved_flops: Optional[Callable[[int], float]] = None, flop_weight: float = 1.0):
        check_rule(eviction)
        self.blocks, self.states, self.block_size = blocks, states, block_size
        self.has_attention, self.has_recurrent = has_attention, has_recurrent
        self.eviction = eviction
        self.saved_flops = saved_flops or (lambda p: float(p))
        self.flop_weight = flop_weight
        self.checkpoints: OrderedDict[bytes, Checkpoint] = OrderedDict()  # least recently used first
        self._clock = 0

    def match(self, hashes: Sequence[bytes], num_tokens: int) -> PrefixMatch:
        """Longest usable prefix L <= num_tokens - 1 of a prompt whose full-block hashes are `hashes`.
        Has no side effects: the caller touches the checkpoint it uses."""
        limit = min(len(hashes), (num_tokens - 1) // self.block_size)
        blocks: list[int] = []
        if self.has_attention:
            for h in hashes[:limit]:
                b = self.blocks.cached.get(h)
                if b is None:
                    break
                blocks.append(b)
            k = len(blocks)
        else:
            k = limit
        m, ckpt = k, None
        if self.has_recurrent:
            while m > 0 and hashes[m - 1] not in self.checkpoints:
                m -= 1
            if m:
                ckpt = self.checkpoints[hashes[m - 1]]
        if not self.has_attention:
            k = m  # no KV to tell where known prefixes run
        miss = None if m else (MISS_NO_KV if k == 0 else MISS_NO_CHECKPOINT)
        branches = (self.has_attention and 0 < k < len(hashes)
                    and self.blocks.has_other_child(hashes[k - 1], hashes[k]))
        return PrefixMatch(m * self.block_size, blocks[:m], ckpt, k * self.block_size, miss, branches)

    def touch(self, h: bytes) -> Checkpoint:
        self._clock += 1
        c = self.checkpoints[h]
        c.last_used = self._clock
        self.checkpoints.move_to_end(h)
        return c

    def add(self, h: bytes, position: int, slot: int) -> None:
        """Register `slot` (already marked CHECKPOINT and filled) as the state after `position` tokens."""
        self._clock += 1
        self.checkpoints[h] = Checkpoint(slot, position, self._clock)

    def reachable(self, h: bytes) -> bool:
        return not self.has_attention or h in self.blocks.cached

    def take_slot(self, kind: str, protect: Optional[bytes] = None, only_output: bool = False) -> Optional[int]:
        """A free state slot marked `kind`, reclaiming checkpoints (unreachable, then by policy) if needed.
        Never evicts the checkpoint keyed `protect`; with `only_output`, evicts only output states.
        None when no slot can be freed."""
        slot = self.states.allocate(kind)
        if slot is not None or not self.checkpoints:
            return slot
        for h in [h for h in self.checkpoints if h != protect and not self.reachable(h)]:
            self.drop(h)
        if self.states.num_free == 0:
            victim = self._victim(protect, only_output)
            if victim is not None:
                self.drop(victim)
        return self.states.allocate(kind)

    def drop(self, h: bytes) -> None:
        self.states.free(self.checkpoints.pop(h).slot)

    def _victim(self, protect: Optional[bytes], only_output: bool = False) -> Optional[bytes]:
        keys = [h for h, c in self.checkpoints.items() if h != protect and (c.output or not only_output)]
        if not keys:
            return None
        i = choose_victim(self.eviction, [self.checkpoints[h].position for h in keys], self.saved_flops,
                          self.flop_weight)
        return keys[i]

    def store(self, h: bytes, position: int, src_slot: int, output: bool = False) -> bool:
        """Copy live slot `src_slot` into a new checkpoint keyed `h`; False if one exists or no slot
        frees. An `output` state (inside generated tokens: only a continuation of that answer can
        use it) may only displace other output states, never a prompt or junction state."""
        if h in self.checkpoints:
            self.touch(h)
            return False
        slot = self.take_slot(CHECKPOINT, only_output=output)
        if slot is None:
            return False
        self.states.copy(src_slot, slot)
        self.add(h, position, slot)
        self.checkpoints[h].output = output
        return True
