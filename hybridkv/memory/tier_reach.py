"""How deep the memory tiers together can take a prompt's prefix, and bringing a position's missing
pieces onto the device: the one rule behind the data-parallel router's probe
(`PrefixCache.usable_tokens`) and an admission's promotion (`PrefixCache.deepest_match`).

A hit after m blocks needs, in every attention group, the KV of the blocks the next token attends
to (full attention: all m; a window: its last ones) and, on a model with state, a state checkpoint
keyed by the hash of block m. Each piece may be in any tier, independently of the others: a block
on the device (a cached block), in the host KV tier (memory/host_kv_tier.py) or on disk
(memory/disk_tier.py); the state on the device, in the host state tier (memory/host_tier.py) or on
disk. So a prefix whose first blocks are on the host and later ones only on disk (or the reverse)
is reached whole, with its state from a third tier: the hybrid hit rule is unchanged (KV of every
kind and a state at the same position), only where each piece comes from is free.

- `reaches` (read-only: index look-ups, no file read, no checksum, no counter, no LRU touch) lists
  the positions every piece of which some tier lists, deepest first, each with where its pieces are.
  The probe takes the deepest; a damaged entry found later is the admission's business.
- `promote` (the admission) takes the deepest such position past the device's hit, checks every
  piece it needs from a lower tier (host entries: layout and CRC-32; disk files: read and verified,
  every one even after one fails, so each damaged file is refused now), and on any failure (the
  entry dropped or the file deleted, counted by its tier) tries again below that position. The
  pieces of the position it takes go to the device together: the host KV entries leave the host
  (one tier at a time), the disk's blocks are copied (the disk keeps its files), all become cached
  blocks of their group in one adoption, and a disk state becomes a device checkpoint. A state in
  the host tier stays there: the admission copies it into the request's live slot.
- `disk_entries` names the files a position takes from the disk, so they can be read before the
  admission (memory/disk_read_ahead.py, on the reader thread); `promote` then takes those staged,
  verified bytes in place of reading them (`staged`), and reads what nothing staged: one path,
  the same checks and placement, only the read moved earlier.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

from .disk_reader import EntryRead, Staged
from .disk_tier import DiskTier
from .kinds import ModelKinds

DEVICE, HOST, DISK = "device", "host", "disk"


@dataclass(frozen=True)
class Reach:
    """A hit after `blocks` blocks and where the device finds what it lacks: host_kv / disk_kv
    {group window: [block index]} to take from the host KV tier / the disk; state: the tier of its
    state checkpoint (DEVICE for a model without state)."""

    blocks: int
    host_kv: dict
    disk_kv: dict
    state: str

    @property
    def promotes(self) -> bool:
        """Whether a piece must come to the device first (a host state needs not: the admission
        copies it into the live slot, and the device's own match sees it)."""
        return self.state == DISK or any(self.host_kv.values()) or any(self.disk_kv.values())


class TierReach:
    """Device, host and disk tiers of one manager's kinds seen together (see the module)."""

    def __init__(self, kinds: ModelKinds, block_size: int, disk: Optional[DiskTier]):
        self.groups = kinds.attention_groups
        self.recurrent = kinds.recurrent
        self.host_kv = kinds.host_kv
        self.host_states = kinds.recurrent.host if kinds.recurrent is not None else None
        self.disk = disk
        self.block_size = block_size

    # ---- where each piece is (read-only) -------------------------------------------------------
    def _kv_tier(self, window: Optional[int], index: int, h: bytes) -> Optional[str]:
        if h in self.groups[window].pool.cached:
            return DEVICE
        if self.host_kv is not None and (window, h) in self.host_kv.entries:
            return HOST
        if self.disk is not None and self.disk.has_kv(window, index, h):
            return DISK
        return None

    def _state_tier(self, key: bytes, position: int) -> Optional[str]:
        if self.recurrent is None:
            return DEVICE  # nothing to resume but the KV
        c = self.recurrent.checkpoints.get(key)
        if c is not None and c.position == position:
            return DEVICE
        e = self.host_states.entries.get(key) if self.host_states is not None else None
        if e is not None and e.position == position:
            return HOST
        if self.disk is not None and self.disk.has_state(key, position):
            return DISK
        return None

    def reaches(self, hashes: Sequence[bytes], limit: int, floor: int = 0) -> Iterator[Reach]:
        """The positions in (floor, limit] blocks (limit at most len(hashes)) whose every piece
        some tier lists, deepest first. Changes nothing."""
        limit = min(limit, len(hashes))
        if limit <= floor:
            return
        where, runs = {}, {}
        for w in self.groups:  # runs[w][i]: blocks in a row ending at block i that some tier holds
            where[w] = [self._kv_tier(w, i, h) for i, h in enumerate(hashes[:limit])]
            run, runs[w] = 0, []
            for t in where[w]:
                run = run + 1 if t is not None else 0
                runs[w].append(run)
        bs = self.block_size
        for m in range(limit, floor, -1):
            first = {w: g.first_needed_block(m * bs) for w, g in self.groups.items()}
            if any(runs[w][m - 1] < m - first[w] for w in self.groups):
                continue
            state = self._state_tier(hashes[m - 1], m * bs)
            if state is None:
                continue
            yield Reach(m, {w: [i for i in range(first[w], m) if where[w][i] == HOST] for w in self.groups},
                        {w: [i for i in range(first[w], m) if where[w][i] == DISK] for w in self.groups}, state)

    def deepest(self, hashes: Sequence[bytes], limit: int) -> int:
        """The deepest position (in blocks, at most `limit`) every piece of which some tier lists; 0 if none."""
        return next((r.blocks for r in self.reaches(hashes, limit)), 0)

    def disk_entries(self, hashes: Sequence[bytes], reach: Reach) -> list[EntryRead]:
        """The files `reach` takes from the disk (its KV blocks, group by group, then its state)."""
        entries = [self.disk.kv_entry(w, i, hashes[i]) for w, idx in reach.disk_kv.items() for i in idx]
        if reach.state == DISK:
            entries.append(self.disk.state_entry(hashes[reach.blocks - 1], reach.blocks * self.block_size))
        return entries

    # ---- bringing a position onto the device ------------------------------------------------------
    def promote(self, hashes: Sequence[bytes], limit: int, floor: int,
                staged: Optional[Mapping[str, Staged]] = None) -> bool:
        """Bring onto the device what the deepest hit past `floor` blocks (at most `limit`) lacks,
        every piece checked first (a failing one is refused by its tier and a shallower position
        tried). staged: disk entries read ahead {file name: Staged}, used in place of reading those
        files while the disk still holds them (what they lack is read now). Returns whether the
        device pools changed (then match again: the hit is there, unless a pool lacked room, or no
        checkpoint slot could take a disk state); False when no position past `floor` is reached
        or the pools lack room for its blocks."""
        while True:
            reach = next(self.reaches(hashes, limit, floor), None)
            if reach is None or not reach.promotes:
                return False
            t0 = time.perf_counter()
            loaded = self._load(hashes, reach, staged)
            if loaded is None:
                limit = reach.blocks - 1  # the failing entries are gone: look below this position
                continue
            charge = self._charge_disk if any(reach.disk_kv.values()) or reach.state == DISK else self._charge_host
            placed = self._place(hashes, reach, *loaded, charge)
            charge(time.perf_counter() - t0)  # (and, on the CPU, the writes' time as each layer runs)
            return placed

    def _load(self, hashes: Sequence[bytes], reach: Reach, staged: Optional[Mapping[str, Staged]]):
        """({window: [(block index, {layer: tensor})]} read from disk, the disk state or None) when
        every piece `reach` takes from a lower tier passes its check; else None. Every piece is
        checked even after one fails, so each damaged one is refused (and recomputed) now."""
        ok = True
        for w, idx in reach.host_kv.items():
            for i in idx:
                ok = self.host_kv.check(w, hashes[i]) and ok
        disk_kv = {}
        for w, idx in reach.disk_kv.items():
            disk_kv[w] = []
            for i in idx:
                t = self.disk.read_kv(w, i, hashes[i], staged)
                ok = ok and t is not None
                if ok:
                    disk_kv[w].append((i, t))
        key, position, state = hashes[reach.blocks - 1], reach.blocks * self.block_size, None
        if reach.state == HOST:
            ok = self.host_states.usable(key, position) and ok
        elif reach.state == DISK:
            state = self.disk.read_state(key, position, staged)
            ok = ok and state is not None
        return (disk_kv, state) if ok else None

    def _charge_disk(self, seconds: float) -> None:
        self.disk.counters.promotion_seconds += seconds

    def _charge_host(self, seconds: float) -> None:
        self.host_kv.counters.kv_promotion_seconds += seconds

    def _place(self, hashes: Sequence[bytes], reach: Reach, disk_kv: dict, state, charge) -> bool:
        """Make the checked pieces device memory: each group's blocks (host and disk together)
        cached blocks in one adoption, then a disk state a device checkpoint (their data written
        layer by layer in the step's forward: hybridkv/layer_loads.py). False, touching
        nothing, when a pool lacks room for the blocks (every group's room is counted first)."""
        m, bs = reach.blocks, self.block_size
        needed = {w: range(g.first_needed_block(m * bs), m) for w, g in self.groups.items()}
        counts = {w: len(reach.host_kv[w]) + len(disk_kv.get(w, ())) for w in self.groups}
        if not all(self.groups[w].pool.has_room_for(hashes, needed[w], n) for w, n in counts.items()):
            return False
        # every host entry leaves first: placing one group's blocks evicts device blocks into the
        # host KV tier, which may drop its oldest entries
        taken = {w: [(i, self.host_kv.take(w, hashes[i])) for i in idx] for w, idx in reach.host_kv.items()}
        blocks = {w: [(i, e.kv, e.parent) for i, e in group] for w, group in taken.items()}
        for w, loaded in disk_kv.items():
            blocks[w] += [(i, kv, hashes[i - 1] if i else b"") for i, kv in loaded]
        if any(disk_kv.values()):
            self.disk.counters.kv_promotions += sum(map(len, disk_kv.values()))
        for w, group_blocks in blocks.items():
            pool = self.groups[w].pool
            pool.adopt(hashes, needed[w], sorted(group_blocks, key=lambda b: b[0]), charge)
            for i, e in taken.get(w, ()):  # a pinned turn's block keeps its pin on the device
                if e.pinned_until:
                    pool.pin([pool.cached[hashes[i]]], e.pinned_until)
        if state is not None:
            self.disk.adopt_state(hashes[m - 1], m * bs, state, charge)  # (no slot: the KV stays cached, the hit shallower)
        elif self.recurrent is None and any(disk_kv.values()):
            self.disk.counters.kv_hits += 1
        return True
