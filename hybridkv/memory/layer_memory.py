"""The interface every kind of layer memory implements: the manager's verbs, for one kind.

A kind owns the pool of its layers (KV blocks, state slots, ...) and each request's share of it,
kept by request id. It never sees another kind: the coordinator (`HybridCacheManager`) runs each
verb over the model's kinds and decides how their answers combine. Positions are in tokens,
prefix lengths in blocks of `block_size` tokens; `hashes[i]` is the chained hash of block i.

Verbs that can refuse come in pairs: `can_*` answers without side effects, then the verb itself
cannot fail. That is how the coordinator keeps "a refused call changes nothing" across kinds.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Hashable, Mapping, Optional, Sequence

import numpy as np
import torch


class LayerMemory(ABC):
    """One kind of layer memory. `layers`: {layer index: spec} of the layers it serves."""

    name: str = "memory"

    def __init__(self, layers: Mapping[int, Any], block_size: int):
        self.layers = dict(layers)
        self.block_size = block_size

    # ---- prefix reuse ----------------------------------------------------------------------
    @abstractmethod
    def usable_prefix(self, hashes: Sequence[bytes], limit: int) -> int:
        """The largest m <= limit (blocks) at which this kind can resume a prompt from cache."""

    def is_cached(self, h: bytes) -> bool:
        """Whether the block with hash h is still findable in this kind's cache (state kinds: True)."""
        return True

    def branches(self, hashes: Sequence[bytes], k: int) -> bool:
        """Whether a cached block continues hashes[:k] with content other than hashes[k]."""
        return False

    # ---- admission and the step ------------------------------------------------------------
    def never_fits(self, num_tokens: int) -> Optional[str]:
        """Why a request of num_tokens (prompt + max_tokens) can never fit, or None."""
        return None

    @abstractmethod
    def can_admit(self, hashes: Sequence[bytes], hit: int, end: int) -> bool:
        """Whether admit(hit) and then allocate up to position `end` would succeed now."""

    @abstractmethod
    def admit(self, rid: Hashable, hashes: Sequence[bytes], hit: int) -> None:
        """Start rid resuming after `hit` cached blocks (copy-on-hit where needed)."""

    def can_allocate(self, rid: Hashable, start: int, end: int) -> bool:
        return True

    def allocate(self, rid: Hashable, start: int, end: int) -> None:
        """Make positions [start, end) writable for rid (call can_allocate first)."""

    def commit(self, rid: Hashable, hashes: Sequence[bytes], num_hashed: int, num_full: int,
               num_computed: int) -> None:
        """rid now has num_computed tokens computed; blocks [num_hashed, num_full) just became full
        and their hashes are hashes[num_hashed:num_full]."""

    decode_commit_always_idle = False  # True: decode_commit_idle is True whatever it is asked

    def decode_commit_idle(self, num_computed: np.ndarray) -> np.ndarray | bool:
        """Per request, whether commit() up to num_computed[i] tokens, one more than before and
        filling no block, would change nothing in this kind (then the manager skips it); an
        array of bools, or True for every one. A kind that overrides commit must say; by
        default, never."""
        return np.zeros(len(num_computed), dtype=bool)

    def trim(self, rid: Hashable, num_tokens: int) -> None:
        """rid keeps only what positions [0, num_tokens) need: memory allocated past them for a
        draft whose tokens were rejected goes back to the pool (it was never committed)."""

    def mark_boundary(self, rid: Hashable, index: int, h: bytes) -> None:
        """A checkpoint is being taken after block `index` (hash h): make that block findable."""

    def checkpoint(self, rid: Hashable, h: bytes, position: int, output: bool, source: Optional[int] = None) -> bool:
        """Keep rid's state after `position` tokens under key h (from state slot `source`: a
        verified draft's slot for that position; None: the live state). Kinds without state: False."""
        return False

    # ---- a request's life ------------------------------------------------------------------
    def can_fork(self) -> bool:
        return True

    @abstractmethod
    def fork(self, parent: Hashable, child: Hashable, num_computed: int) -> None:
        """child shares (or gets a copy of) parent's memory of its first num_computed tokens."""

    @abstractmethod
    def release(self, rid: Hashable, donate: Optional[tuple[bytes, int]] = None) -> None:
        """Let go of rid's memory in this pool (blocks, live and draft slots; full blocks stay
        findable by hash). rid may come back (preempt by recompute, swap out) or be ending (the
        manager's finish, which then calls forget). donate=(hash, position): a state kind keeps
        the live state as a checkpoint there instead of freeing it. Holding nothing: a no-op."""

    def forget(self, rid: Hashable) -> None:
        """rid has ended for good (finished, aborted, failed; released first if it held memory):
        drop what the kind keeps about it beyond its memory (the recurrent kind: which checkpoint
        is its rolling output state). Frees no pool memory."""

    @abstractmethod
    def swap_bytes(self, rid: Hashable, num_computed: int) -> int:
        """The host bytes swap_out(rid, num_computed) would copy (the host budget holds them)."""

    @abstractmethod
    def swap_out(self, rid: Hashable, num_computed: int) -> Any:
        """Copy rid's memory to host, release it here; returns the host copy."""

    @abstractmethod
    def can_swap_in(self, copy: Any, end: int) -> bool:
        """Whether swap_in(copy) and then allocate up to position `end` would succeed now."""

    @abstractmethod
    def swap_in(self, rid: Hashable, copy: Any, hashes: Sequence[bytes], num_computed: int) -> None:
        """Place a host copy back (fresh blocks / slot) and make its full blocks findable again."""

    @abstractmethod
    def export(self, rid: Hashable, num_computed: int, device: torch.device | str) -> dict:
        """rid's memory as tensors for a RequestSnapshot (fields kv / kv_start / conv / ssm)."""

    @abstractmethod
    def check_import(self, part: dict, num_computed: int) -> None:
        """Raise SnapshotMismatchError naming the layer, the value and what was expected if an
        exported part does not fit this kind's layers exactly (shape, dtype, finite values)."""

    @abstractmethod
    def can_import(self, part: dict, num_computed: int, end: int) -> bool:
        """Whether import_(part) and then allocate up to position `end` would succeed now."""

    @abstractmethod
    def import_(self, rid: Hashable, part: dict, hashes: Sequence[bytes], num_computed: int) -> None:
        """Place an exported part (any block size) for rid."""

    def layer_shapes(self) -> dict[int, tuple]:
        """{layer: what one token / slot holds, with dtypes}: imports must match exactly."""
        return {}

    @abstractmethod
    def stats(self) -> dict:
        """Counters of this kind's pool (names are the kind's own)."""
