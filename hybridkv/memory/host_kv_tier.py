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

A model without attention layers has no KV tier. With tensor parallelism the pool's gather
returns every rank's heads, which the tier keeps whole.
"""
from __future__ import annotations

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
    def demote(self, window: Optional[int], evicted: Sequence[tuple[int, bytes, Optional[bytes]]]) -> None:
        """Blocks (block, hash, parent hash) group `window`'s pool is evicting, least useful first:
        as many of the last ones as the budget can hold are copied here (older KV entries go)."""
        nb = self._block_bytes[window]
        room = self.budget_bytes - self.held_elsewhere()
        todo = [e for e in evicted if (window, e[1]) not in self.entries][-(room // nb):] if room >= nb and nb else []
        if not todo:
            return
        self.shrink(len(todo) * nb - (room - self.used_bytes))
        data = self.groups[window].pool.gather([b for b, _, _ in todo], "cpu")
        for j, (_, h, parent) in enumerate(todo):
            kv = {i: t[j].clone() for i, t in data.items()}
            self.entries[(window, h)] = HostKvEntry(parent, kv, checksum(kv, {}), nb)
            self.used_bytes += nb
        self.counters.kv_demotions += len(todo)

    def shrink(self, nbytes: int) -> None:
        """Free at least `nbytes` of this tier's bytes (least recently used entries first)."""
        freed = 0
        while freed < nbytes and self.entries:
            freed += self.entries.popitem(last=False)[1].nbytes
            self.counters.kv_evictions += 1
        self.used_bytes -= freed

    def drop(self, window: Optional[int], h: bytes) -> None:
        """Forget the host copy of block `h` of group `window` (a device block answers for it again)."""
        e = self.entries.pop((window, h), None)
        if e is not None:
            self.used_bytes -= e.nbytes

    # ---- promotion (the admission's: memory/tier_reach.py decides what a hit takes from here) --
    def check(self, window: Optional[int], h: bytes) -> bool:
        """The entry exists and passes the check (layout, CRC-32); a failing one is dropped, counted."""
        e = self.entries.get((window, h))
        if e is None:
            return False
        if {i: (tuple(t.shape), t.dtype) for i, t in e.kv.items()} == self._layout[window] and checksum(e.kv, {}) == e.crc:
            return True
        self.used_bytes -= self.entries.pop((window, h)).nbytes
        self.counters.kv_refused_corrupt += 1
        return False

    def take(self, window: Optional[int], h: bytes) -> HostKvEntry:
        """Remove a checked entry to put it into a device block: a block is in one tier at a time."""
        e = self.entries.pop((window, h))
        self.used_bytes -= e.nbytes
        self.counters.kv_promotions += 1
        return e

    def stats(self) -> dict:
        c = self.counters
        return {"kv_entries": len(self.entries), "kv_bytes": self.used_bytes, "kv_promotions": c.kv_promotions,
                "kv_demotions": c.kv_demotions, "kv_evictions": c.kv_evictions,
                "kv_refused_corrupt": c.kv_refused_corrupt, "kv_promotion_seconds": c.kv_promotion_seconds}


class _PoolHook:
    """What a group's BlockPool calls (`pool.host_kv`): evicting(blocks) and superseded(hash)."""

    __slots__ = ("tier", "window")

    def __init__(self, tier: HostKvTier, window: Optional[int]):
        self.tier, self.window = tier, window

    def evicting(self, evicted) -> None:
        self.tier.demote(self.window, evicted)

    def superseded(self, h: bytes) -> None:
        if self.tier.entries:
            self.tier.drop(self.window, h)
