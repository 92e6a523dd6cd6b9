"""The disk tier: KV blocks and state checkpoints in files that outlive the process, so a restarted
engine finds the prefixes an earlier one computed.

A hit needs the KV of every block of the prefix (each attention group: the blocks the next token
attends to) AND a state checkpoint at the same position, so the tier keeps both, as files of a
DiskStore (disk_store.py; format: disk_format.py), keyed by the chained block hash:

- **When written: write-through along checkpoints.** Whenever a state checkpoint is made on the
  device (`PrefixCache.store`: the policy's prompt ends, junctions, bursts, the rolling output
  state) or a finished / preempted request leaves its final state as one (a donation), the state
  and the KV blocks a hit at that position needs that the disk lacks are copied to the host at
  once and queued for the writer thread. That is where a later request can resume, so it is what
  survives a restart; KV past the last checkpoint is never usable by a hybrid and is not written.
  (vLLM's and LMCache's disk offload and SGLang HiCache's storage backend also write through as
  blocks are computed; writing on demotion instead would lose every entry still on the device at
  a restart or a crash.) A model without recurrent layers writes every block as it fills (any
  block boundary is a usable prefix there), before a sliding window lets it go.
- **When read: at admission**, when the tiers together reach deeper than the device's hit: which
  position, and which of its pieces come from here, is decided for every tier at once
  (memory/tier_reach.py: a block may come from the host KV tier and the next from here, the state
  from a third tier). This file answers whether its index lists an entry (`has_kv`, `has_state`:
  no I/O, so the router's probe may ask) and reads one (`read_kv`, `read_state`): each file
  verified first (disk_format.py: kind, key, position, namespace, dtypes, shapes, CRC-32); a file
  that fails is deleted, counted (`refused_corrupt`), and the caller tries a shallower position, so
  a corrupt entry is never used. Loading PROMOTES: the KV into free device blocks that become
  cached blocks under their hashes, the state into a device checkpoint slot (`adopt_state`). Then
  the ordinary prefix match runs: the hybrid hit rule is unchanged.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional, Sequence

from .disk_store import DiskStore
from .kinds import ModelKinds

FORMAT_VERSION = 1
DEFAULT_DISK_CACHE_BYTES = 16 << 30  # 16 GiB: a few hundred long prefixes of a 7-9B hybrid


def namespace_of(fingerprint: str, block_size: int, kinds: ModelKinds) -> tuple[str, dict]:
    """(a digest naming the directory of this model's entries, what it digests): the model
    fingerprint, block size and every layer's stored shapes and cache dtypes. Another model,
    block size or cache dtype uses another directory, so its files are never mistaken for these."""
    layers = {}
    for kind in kinds.all:
        for i, shape in kind.layer_shapes().items():
            layers[f"{kind.name}.{i}"] = repr(shape)
    describe = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "block_size": block_size, "layers": layers}
    digest = hashlib.sha256(json.dumps(describe, sort_keys=True).encode()).hexdigest()[:20]
    return digest, describe


def _group_label(window: Optional[int]) -> str:
    return "full" if window is None else f"w{window}"


@dataclass
class DiskTierCounters:
    kv_hits: int = 0             # admissions of a model without state that used disk KV
    promotions: int = 0          # states loaded from disk into a device checkpoint slot
    kv_promotions: int = 0       # KV blocks loaded from disk into device blocks
    promotion_seconds: float = 0.0  # reading, verifying and copying them in
    demotions: int = 0           # states queued for writing
    kv_demotions: int = 0        # KV blocks queued for writing


class DiskTier:
    """The disk tier of a manager's kinds (`kinds`: every attention group and the recurrent kind)."""

    def __init__(self, kinds: ModelKinds, block_size: int, root: str, budget_bytes: int, fingerprint: str):
        self.groups = kinds.attention_groups
        self.recurrent = kinds.recurrent
        self.block_size = block_size
        namespace, describe = namespace_of(fingerprint, block_size, kinds)
        self.store = DiskStore(root, namespace, budget_bytes, describe)
        self.counters = DiskTierCounters()
        self._kv_layout = {w: [(f"kv.{i}", t.dtype, tuple(t.shape[1:])) for i, t in g.pool.kv.items()]
                           for w, g in self.groups.items()}
        self._state_layout = []
        if self.recurrent is not None:
            st = self.recurrent.states
            self._state_layout = [(f"conv.{i}", t.dtype, tuple(t.shape[1:])) for i, t in st.conv.items()] + \
                                 [(f"ssm.{i}", t.dtype, tuple(t.shape[1:])) for i, t in st.ssm.items()]

    # ---- names -------------------------------------------------------------------------------
    @staticmethod
    def state_name(key: bytes, position: int) -> str:
        return f"state-{position}-{key.hex()}.hkv"

    @staticmethod
    def kv_name(window: Optional[int], index: int, key: bytes) -> str:
        return f"kv-{_group_label(window)}-{index}-{key.hex()}.hkv"

    def _needed(self, window: Optional[int], m: int) -> range:
        """Block indices of group `window` a hit after m blocks takes (full attention: all)."""
        return range(self.groups[window].first_needed_block(m * self.block_size), m)

    # ---- writes ------------------------------------------------------------------------------
    def write(self, rid, hashes: Sequence[bytes], position: int, slot: Optional[int]) -> None:
        """Queue what a hit at `position` (a block boundary) needs that the disk lacks: the KV
        blocks request `rid` holds there and, when `slot` is given, the state in that slot (taken
        after `position` tokens). The bytes are copied to the host now; files are written by the
        store's thread."""
        m = position // self.block_size
        if m < 1 or m > len(hashes):
            return
        for w in self.groups:
            self._write_kv(w, rid, hashes, self._needed(w, m))
        if slot is not None and self.recurrent is not None:
            key = hashes[m - 1]
            name = self.state_name(key, position)
            if not self.store.has(name):
                conv, ssm = self.recurrent.states.to_host(slot, "cpu")
                tensors = [(f"conv.{i}", t) for i, t in conv.items()] + [(f"ssm.{i}", t) for i, t in ssm.items()]
                if self.store.put(name, "state", key, position, tensors):
                    self.counters.demotions += 1

    def write_blocks(self, rid, hashes: Sequence[bytes], start: int, end: int) -> None:
        """Queue blocks [start, end) of request rid, just full (their hashes in `hashes`), of every
        attention group that holds them (a model without state: every block is a usable prefix)."""
        for w in self.groups:
            self._write_kv(w, rid, hashes, range(start, end))

    def _write_kv(self, w: Optional[int], rid, hashes: Sequence[bytes], indices: range) -> None:
        """Queue the blocks at `indices` that group w holds for rid and the disk lacks."""
        g = self.groups[w]
        blocks = g.block_ids(rid)
        todo = [i for i in indices
                if i < len(blocks) and blocks[i] >= 0 and not self.store.has(self.kv_name(w, i, hashes[i]))]
        if not todo:
            return
        data = g.pool.gather([blocks[i] for i in todo], "cpu")
        for j, i in enumerate(todo):
            tensors = [(f"kv.{layer}", t[j]) for layer, t in data.items()]
            if self.store.put(self.kv_name(w, i, hashes[i]), "kv", hashes[i], (i + 1) * self.block_size, tensors):
                self.counters.kv_demotions += 1

    def write_checkpoint(self, rid, hashes: Sequence[bytes], position: int) -> None:
        """A device checkpoint was just made at `position` for request rid: write it through."""
        c = self.recurrent.checkpoints.get(hashes[position // self.block_size - 1])
        if c is not None and c.position == position:
            self.write(rid, hashes, position, c.slot)

    def invalidate(self, key: bytes) -> bool:
        """Delete every state entry under `key` (the prefix-hit guard found it wrong)."""
        names = [n for n in self.store.names("state-") if n.endswith(f"-{key.hex()}.hkv")]
        for n in names:
            self.store.remove(n)
        return bool(names)

    # ---- reads (the admission's: memory/tier_reach.py decides what a hit takes from here) ------
    def has_kv(self, window: Optional[int], index: int, key: bytes) -> bool:
        """Whether the index lists block `index` (hash `key`) of group `window` (no I/O, no LRU touch)."""
        return self.store.has(self.kv_name(window, index, key))

    def has_state(self, key: bytes, position: int) -> bool:
        """Whether the index lists the state after `position` tokens keyed `key` (no I/O, no LRU touch)."""
        return self.recurrent is not None and self.store.has(self.state_name(key, position))

    def read_kv(self, window: Optional[int], index: int, key: bytes) -> Optional[dict]:
        """{layer: one block's host tensor} of that file, verified; None when it is missing or
        fails a check (then deleted and counted)."""
        t = self.store.read(self.kv_name(window, index, key), "kv", key, (index + 1) * self.block_size,
                            self._kv_layout[window])
        return None if t is None else {layer: t[f"kv.{layer}"] for layer in self.groups[window].pool.kv}

    def read_state(self, key: bytes, position: int) -> Optional[tuple[dict, dict]]:
        """(conv, ssm) {layer: host tensor} of that state file, verified; None as read_kv."""
        t = self.store.read(self.state_name(key, position), "state", key, position, self._state_layout)
        if t is None:
            return None
        st = self.recurrent.states
        return {i: t[f"conv.{i}"] for i in st.conv}, {i: t[f"ssm.{i}"] for i in st.ssm}

    def adopt_state(self, key: bytes, position: int, state: tuple[dict, dict], charge=None) -> bool:
        """Make a state read_state() returned the device checkpoint keyed `key` (its first hit
        counts as the disk's); False when no checkpoint slot can be freed."""
        if not self.recurrent.adopt(key, position, *state, charge):
            return False
        self.counters.promotions += 1
        return True

    # ---- life --------------------------------------------------------------------------------
    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()

    def stats(self) -> dict:
        s, c = self.store.stats(), self.counters
        states = self.store.count("state")
        hits = self.recurrent.disk_hits if self.recurrent is not None else c.kv_hits
        return {"entries": states, "kv_entries": self.store.count("kv"), "bytes": s["bytes"],
                "budget_bytes": s["budget_bytes"], "hits": hits, "promotions": c.promotions,
                "kv_promotions": c.kv_promotions, "promotion_seconds": c.promotion_seconds,
                "demotions": c.demotions, "kv_demotions": c.kv_demotions, "evictions": s["evictions"],
                "refused_corrupt": s["refused_corrupt"], "write_seconds": s["write_seconds"],
                "write_errors": s["write_errors"], "dropped_writes": s["dropped_writes"]}
