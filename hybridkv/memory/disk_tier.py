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
- **When read: ahead of admission, on the reader thread**, when the tiers together reach deeper
  than the device's hit: which position, and which of its pieces come from here, is decided for
  every tier at once (memory/tier_reach.py: a block may come from the host KV tier and the next from
  here, the state from a third tier). This file answers whether its index lists an entry (`has_kv`,
  `has_state`: no I/O, so the router's probe may ask) and reads one (`read_entry`, the one read of
  a file: disk_format.py checks kind, key, position, namespace, dtypes, shapes, CRC-32; a file that
  fails is deleted, counted (`refused_corrupt`), and the caller tries a shallower position, so a
  corrupt entry is never used). A waiting request's files are read by `reader` (disk_reader.py, a
  thread; memory/disk_read_ahead.py holds the request meanwhile), and its admission's `read_kv` /
  `read_state` take those staged, verified bytes; what nothing staged (the reader off or over its
  bound, the position changed meanwhile) they read on the step's thread, counted (`sync_reads`).
  Loading PROMOTES: the KV into free device blocks that become cached blocks under their hashes,
  the state into a device checkpoint slot (`adopt_state`). Then the ordinary prefix match runs:
  the hybrid hit rule is unchanged.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .disk_reader import DEFAULT_READ_AHEAD_BYTES, DiskReader, EntryRead, Staged
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
    promotion_seconds: float = 0.0  # reading (what nothing staged), verifying and copying them in
    sync_reads: int = 0          # entries the admission read on the step's thread (nothing staged them)
    read_wait_seconds: float = 0.0  # requests held back while the reader read their entries
    demotions: int = 0           # states queued for writing
    kv_demotions: int = 0        # KV blocks queued for writing


class DiskTier:
    """The disk tier of a manager's kinds (`kinds`: every attention group and the recurrent kind)."""

    def __init__(self, kinds: ModelKinds, block_size: int, root: str, budget_bytes: int, fingerprint: str,
                 read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES):
        """read_ahead_bytes: the reader thread's bound on bytes in flight or staged (0: no reader,
        every read on the step's thread, as at admission before it existed)."""
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
        self.reader = DiskReader(self.read_entry, read_ahead_bytes) if read_ahead_bytes else None

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

    def kv_entry(self, window: Optional[int], index: int, key: bytes) -> EntryRead:
        """What reading block `index` (hash `key`) of group `window` expects of its file."""
        name = self.kv_name(window, index, key)
        return EntryRead(name, "kv", key, (index + 1) * self.block_size, self._kv_layout[window],
                         self.store.size(name))

    def state_entry(self, key: bytes, position: int) -> EntryRead:
        """What reading the state after `position` tokens keyed `key` expects of its file."""
        name = self.state_name(key, position)
        return EntryRead(name, "state", key, position, self._state_layout, self.store.size(name))

    def read_entry(self, e: EntryRead) -> Optional[Staged]:
        """The one read of an entry file, on either thread: its tensors, verified, with the store's
        serial of the name; None when it is missing or fails a check (then deleted and counted)."""
        serial = self.store.serial(e.name)  # taken first: a newer entry read under it is only re-read
        t = self.store.read(e.name, e.kind, e.key, e.position, e.layout)
        return None if t is None else Staged(t, serial)

    def fresh(self, s: Optional[Staged], name: str) -> bool:
        """Whether `s`, read ahead from file `name`, is of the entry the store holds under it now."""
        return s is not None and s.serial is not None and s.serial == self.store.serial(name)

    def _tensors(self, e: EntryRead, staged: Optional[Mapping[str, Staged]]) -> Optional[dict]:
        """e's tensors: staged ones while the store still holds the entry they were read from, else
        read now (on the step's thread, counted)."""
        s = staged.get(e.name) if staged else None
        if self.fresh(s, e.name):
            return s.tensors
        self.counters.sync_reads += 1
        got = self.read_entry(e)
        return None if got is None else got.tensors

    def read_kv(self, window: Optional[int], index: int, key: bytes,
                staged: Optional[Mapping[str, Staged]] = None) -> Optional[dict]:
        """{layer: one block's host tensor} of that file, verified (staged: read ahead, by name);
        None when it is missing or fails a check (then deleted and counted)."""
        t = self._tensors(self.kv_entry(window, index, key), staged)
        return None if t is None else {layer: t[f"kv.{layer}"] for layer in self.groups[window].pool.kv}

    def read_state(self, key: bytes, position: int,
                   staged: Optional[Mapping[str, Staged]] = None) -> Optional[tuple[dict, dict]]:
        """(conv, ssm) {layer: host tensor} of that state file, verified; None as read_kv."""
        t = self._tensors(self.state_entry(key, position), staged)
        if t is None:
            return None
        st = self.recurrent.states
        return {i: t[f"conv.{i}"] for i in st.conv}, {i: t[f"ssm.{i}"] for i in st.ssm}

    def adopt_state(self, key: bytes, position: int, state: tuple[dict, dict], charge=None) -> bool:
        """Make a state read_state() returned the device checkpoint keyed `key` (its first hit
        counts as the disk's); False when no checkpoint slot can be freed."""
        if not self.recurrent.store.adopt(key, position, *state, charge):
            return False
        self.counters.promotions += 1
        return True

    # ---- life --------------------------------------------------------------------------------
    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        """Stop the reader, then finish the queued writes and stop the writer."""
        if self.reader is not None:
            self.reader.close()
        self.store.close()

    def stats(self) -> dict:
        s, c = self.store.stats(), self.counters
        r = self.reader.counters if self.reader is not None else None
        states = self.store.count("state")
        hits = self.recurrent.store.disk_hits if self.recurrent is not None else c.kv_hits
        return {"entries": states, "kv_entries": self.store.count("kv"), "bytes": s["bytes"],
                "budget_bytes": s["budget_bytes"], "hits": hits, "promotions": c.promotions,
                "kv_promotions": c.kv_promotions, "promotion_seconds": c.promotion_seconds,
                "demotions": c.demotions, "kv_demotions": c.kv_demotions, "evictions": s["evictions"],
                "refused_corrupt": s["refused_corrupt"], "write_seconds": s["write_seconds"],
                "write_errors": s["write_errors"], "dropped_writes": s["dropped_writes"],
                "background_reads": r.reads if r else 0, "background_read_seconds": r.read_seconds if r else 0.0,
                "sync_reads": c.sync_reads, "read_wait_seconds": c.read_wait_seconds}
