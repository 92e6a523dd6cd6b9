"""The host tier of KV blocks: full, hashed blocks the device pools evict, kept in host memory under
the host budget (`host_cache_bytes`) and found again by a later prefix match.

- **Demote.** When a pool hands out a free block that still answers for a hash (`BlockPool.allocate`
  evicts it), it tells this tier before the new owner writes the block (`BlockPool.host_kv`): the
  blocks are copied to the host in one gather, each kept under (attention group, hash) with its
  parent hash, its layout and a CRC-32 of its bytes.
- **One budget.** States and swapped requests come first (memory/host_tier.py): KV entries use what
  they leave of the budget and give way, least recently used first, when a state or a swap needs
  room; among themselves KV entries go least recently used first. On a hybrid a KV block alone
  saves nothing (a hit needs a state at the same position), while a state saves its whole prefix.
- **Promote.** At admission (`PrefixCache.deepest_match`), when the tiers together reach deeper
  than the device's hit (memory/tier_reach.py decides the position for every tier at once: its
  blocks may come from here, from the disk or both, and its state from any tier). Every entry used
  is checked first (`check`: key, layout, CRC-32); one that fails is dropped and counted
  (`kv_refused_corrupt`) and that position is not used. The blocks go into free device blocks as
  cached blocks (chain order) and LEAVE the host (`take`: a block is in one tier at a time: a
  device block that comes to answer for a hash the host holds, as when the prefix is recomputed,
  drops the host copy; evicted again, it is demoted again). Then the ordinary match runs: the
  hybrid hit rule is unchanged.
- **Pins.** A pinned turn's block (BlockPool.pin) the pool must hand out (a running request needs
  it) comes here with its deadline, before any unpinned block of the same eviction; here it is
  never evicted for another KV entry or a state demotion, only for a swapped request's bytes
  (counted in `pins_reclaimed`, as a block the host could not take is counted by the pool). Promoted
  or superseded by a device block, its pin goes with it to that block.

A model without attention layers has no KV tier. With tensor parallelism the pool's gather
returns every rank's heads, which the tier keeps whole.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from .host_tier import checksum


@dataclass
class HostKvEntry:
    parent: Optional[bytes]  # the hash of the block before it (b"" for a first block)
    kv: dict                 # {layer: host tensor of one block}
    crc: int
    nbytes: int
    pinned_until: float = 0.0  # a pinned turn's block (monotonic deadline; 0: not pinned)

    def pinned(self, now: float) -> bool:
        return self.pinned_until > now


@dataclass
class KvTierCounters:
    kv_promotions: int = 0        # blocks copied from here into device blocks
    kv_demotions: int = 0         # evicted device blocks copied here
    kv_evictions: int = 0         # entries dropped for room
    kv_refused_corrupt: int = 0   # entries that failed the check (dropped unused)
    kv_promotion_seconds: float = 0.0


class HostKvTier:
    """Host copies of evicted KV blocks of `groups` ({window: FullAttentionMemory}) within
    `budget_bytes`, less what `held_elsewhere()` (the state tier's entries and swapped requests)
    takes. Registers itself as every group pool's `host_kv` hook (_PoolHook)."""

    def __init__(self, groups: Mapping[Optional[int], object], block_size: int, budget_bytes: int,
                 held_elsewhere: Callable[[], int] = lambda: 0):
        self.groups = dict(groups)
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.held_elsewhere = held_elsewhere
        self.entries: OrderedDict[tuple, HostKvEntry] = OrderedDict()  # (window, hash); least recently used first
        self.used_bytes = 0
        self.counters = KvTierCounters()
        self.pins_reclaimed = 0  # pinned entries evicted before their deadline (a swap needed the bytes)
        self._layout = {w: {i: (tuple(t.shape[1:]), t.dtype) for i, t in g.pool.kv.items()}
                        for w, g in self.groups.items()}
        self._block_bytes = {w: sum(t[0].numel() * t.element_size() for t in g.pool.kv.values())
                             for w, g in self.groups.items()}
        for w, g in self.groups.items():
            g.pool.host_kv = _PoolHook(self, w)

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def reachable(self, window: Optional[int], h: bytes) -> bool:
        """Whether group `window` holds block `h` on the device or here."""
        return h in self.groups[window].pool.cached or (window, h) in self.entries

    # ---- demotion ----------------------------------------------------------------------------
    def demote(self, window: Optional[int], evicted: Sequence[tuple[int, bytes, Optional[bytes], float]]) -> int:
        """Blocks (block, hash, parent hash, pin deadline or 0) group `window`'s pool is evicting,
        least useful first: the pinned ones, then as many of the last ones as the budget holds beside
        the pinned entries here, are copied here (unpinned KV entries go). Returns how many pinned
        blocks were kept with their pin (the pool counts the others as reclaimed)."""
        nb, now = self._block_bytes[window], time.monotonic()
        fits = (self.budget_bytes - self.held_elsewhere() - self.pinned_bytes()) // nb if nb else 0
        new = [e for e in evicted if (window, e[1]) not in self.entries]
        pinned = [e for e in new if e[3] > now][-fits:] if fits > 0 else []
        rest = fits - len(pinned)
        todo = pinned + ([e for e in new if e[3] <= now][-rest:] if rest > 0 else [])
        if not todo:
            return 0
        self.shrink(len(todo) * nb - (self.budget_bytes - self.held_elsewhere() - self.used_bytes))
        data = self.groups[window].pool.gather([e[0] for e in todo], "cpu")
        for j, (_, h, parent, until) in enumerate(todo):
            kv = {i: t[j].clone() for i, t in data.items()}
            self.entries[(window, h)] = HostKvEntry(parent, kv, checksum(kv, {}), nb, until if until > now else 0.0)
            self.used_bytes += nb
        self.counters.kv_demotions += len(todo)
        return len(pinned)

    def pinned_bytes(self) -> int:
        """The bytes of the entries pinned now (a state demotion never evicts them)."""
        now = time.monotonic()
        return sum(e.nbytes for e in self.entries.values() if e.pinned_until and e.pinned(now))

    def pinned_entries(self) -> int:
        now = time.monotonic()
        return sum(1 for e in self.entries.values() if e.pinned_until and e.pinned(now))

    def shrink(self, nbytes: int, pinned_too: bool = False) -> None:
        """Free at least `nbytes` of this tier's bytes, least recently used entries first, unpinned
        ones only unless `pinned_too` (a swapped request's bytes: then pinned ones go last, counted)."""
        now, freed = time.monotonic(), 0
        order = [k for k, e in self.entries.items() if not e.pinned(now)]
        if pinned_too:
            order += [k for k, e in self.entries.items() if e.pinned(now)]
        for k in order:
            if freed >= nbytes:
                break
            e = self.entries.pop(k)
            freed += e.nbytes
            self.pins_reclaimed += e.pinned(now)
            self.counters.kv_evictions += 1
        self.used_bytes -= freed

    def drop(self, window: Optional[int], h: bytes) -> float:
        """Forget the host copy of block `h` of group `window` (a device block answers for it again);
        returns its pin deadline (0.0: none), for that block to keep."""
        e = self.entries.pop((window, h), None)
        if e is None:
            return 0.0
        self.used_bytes -= e.nbytes
        return e.pinned_until

    # ---- promotion (the admission's: memory/tier_reach.py decides what a hit takes from here) --
    def check(self, window: Optional[int], h: bytes) -> bool:
        """The entry exists and passes the check (layout, CRC-32); a failing one is dropped, counted."""
        e = self.entries.get((window, h))
        if e is None:
            return False
        if {i: (tuple(t.shape), t.dtype) for i, t in e.kv.items()} == self._layout[window] and checksum(e.kv, {}) == e.crc:
            return True
        e = self.entries.pop((window, h))
        self.used_bytes -= e.nbytes
        self.pins_reclaimed += e.pinned(time.monotonic())  # (a pinned block lost before its deadline)
        self.counters.kv_refused_corrupt += 1
        return False

    def take(self, window: Optional[int], h: bytes) -> HostKvEntry:
        """Remove a checked entry to put it into a device block: a block is in one tier at a time
        (the caller pins that block until the entry's `pinned_until`, when it has one)."""
        e = self.entries.pop((window, h))
        self.used_bytes -= e.nbytes
        self.counters.kv_promotions += 1
        return e

    def stats(self) -> dict:
        c = self.counters
        return {"kv_entries": len(self.entries), "kv_bytes": self.used_bytes, "kv_promotions": c.kv_promotions,
                "kv_demotions": c.kv_demotions, "kv_evictions": c.kv_evictions,
                "kv_refused_corrupt": c.kv_refused_corrupt, "kv_promotion_seconds": c.kv_promotion_seconds,
                "kv_pinned_entries": self.pinned_entries()}


class _PoolHook:
    """What a group's BlockPool calls (`pool.host_kv`): evicting(blocks) and superseded(hash)."""

    __slots__ = ("tier", "window")

    def __init__(self, tier: HostKvTier, window: Optional[int]):
        self.tier, self.window = tier, window

    def evicting(self, evicted) -> int:
        return self.tier.demote(self.window, evicted)

    def superseded(self, h: bytes) -> float:
        return self.tier.drop(self.window, h) if self.tier.entries else 0.0
