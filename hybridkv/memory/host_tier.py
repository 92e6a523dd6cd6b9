"""The host tier of recurrent-state checkpoints: states evicted from the device slots, kept in host
memory under a byte budget of their own, still usable for prefix hits.

When the device slots must evict a checkpoint (memory/state_checkpoints.py), the state is DEMOTED here
instead of dropped if it is worth its bytes: it competes with the host entries under the same
eviction rule as the device (hybridkv/eviction.py; unreachable entries first, then the lowest
score), and it is refused when it would be the victim itself. Three differences from the device,
all for the states a host tier exists to keep (BENCHMARKS.md, "Memory tiers"):
- No penalty for a state some request ran past: here an inner state is a fallback for the next
  request that branches off below the deeper states of its chain (the policy's trail).
- An output state (inside a request's answer) is worth the tokens since the nearest state kept
  before it on its path, not its whole position (Marconi's FLOPs of a tree node's edge): the
  state after a short answer to a prompt whose end is kept saves only the answer's tokens.
- FLOPs saved weigh 1.5x more against recency (HOST_FLOP_SCALE): entries live longer here.

A prefix match sees a host entry as a checkpoint; the admission that uses it PROMOTES it: the
state is copied into the new live slot (the host entry stays, as a device checkpoint stays after a
copy-on-hit). Before an entry is used its key, position, tensor shapes, dtypes and a CRC-32 of its
bytes are checked; an entry that fails is dropped and counted (`refused_corrupt`), never used. A key is never in both tiers: a device
checkpoint made under a key this tier holds supersedes the host copy (`discard`).

Swap preemption uses the same host memory and budget: a request swapped out HOLDS its bytes here
(`hold`) until it is swapped back in or ends (`let_go`). Live work comes first: entries are evicted
for it by the same rule, and a swap that would not fit even with every entry gone is refused (the
manager then preempts by recompute). Entries never evict a swapped request's bytes.

Pinned turns' states (memory/state_pins.py) come here still pinned when the device evicts them for
a running request's slot. A pinned entry is never evicted for another entry: a demotion evicts
unreachable and unpinned entries only, and a pinned newcomer is never refused by the rule (it
evicts unpinned entries, the KV entries included, until it fits); one that would not fit beside
the pins already here is dropped, its pin lost and counted (`refused_pinned`). Only a swapped
request's bytes (a running request's memory) take a pinned entry, last and counted.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from hybridkv.eviction import choose_victim

from .state_pins import StatePins

# The host weighs the FLOPs a state saves 1.5x as much as the device's rule does against recency: an
# entry here outlives many more admissions than a device checkpoint, so its recency says less about
# its reuse (BENCHMARKS.md, "Memory tiers": weights 1 / 1.5 / 2 / 3 over 13 trace seeds).
HOST_FLOP_SCALE = 1.5


def _bytes_of(t: torch.Tensor):
    """A uint8 numpy view of a contiguous host tensor's bytes (any dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def checksum(conv: Mapping[int, torch.Tensor], ssm: Mapping[int, torch.Tensor]) -> int:
    """CRC-32 over every tensor's bytes, conv layers then ssm layers in layer order."""
    crc = 0
    for part in (conv, ssm):
        for i in sorted(part):
            crc = zlib.crc32(_bytes_of(part[i]), crc)
    return crc


@dataclass
class HostEntry:
    """A demoted state: `conv` / `ssm` {layer: tensor} on the host, the key and position it was
    kept under, `layout` {(part, layer): (shape, dtype)} and the CRC-32 taken when it came here."""

    key: bytes
    position: int
    last_used: int
    conv: dict
    ssm: dict
    layout: dict
    crc: int
    nbytes: int
    worth: int  # the tokens its saved FLOPs are counted for: its position, or an output state's edge


@dataclass
class TierCounters:
    hits: int = 0              # admissions that used a host entry (each one a promotion)
    promotions: int = 0        # states copied from here into a device slot
    demotions: int = 0         # states taken in from the device
    refused_demotions: int = 0 # device evictions not worth their host bytes (dropped)
    evictions: int = 0         # entries dropped for room (or unreachable)
    refused_corrupt: int = 0   # entries that failed the check and were dropped unused
    swaps_refused: int = 0     # swap preemptions the budget could not hold (preempted by recompute)
    pinned_demotions: int = 0  # pinned states taken in with their pin (counted in demotions too)
    refused_pinned: int = 0    # pinned states that did not fit beside the pins here (their pin lost)
    promotion_seconds: float = 0.0  # host time of the promotions: issue + (CPU) the layer-wise writes


class HostStateTier:
    """Host copies of state checkpoints under `budget_bytes`.

    rule / saved_flops / branches / reachable / flop_weight: the device's eviction rule and its
    inputs (memory/state_checkpoints.py), applied to the host entries. pins: the pinned turns' states,
    shared with the device (a pin follows its state between the tiers)."""

    def __init__(self, budget_bytes: int, rule: str, saved_flops: Callable[[int], float],
                 branches: Callable[[bytes], int], reachable: Callable[[bytes], bool], flop_weight: float = 1.0,
                 pins: Optional[StatePins] = None):
        if budget_bytes < 0:
            raise ValueError(f"host_cache_bytes={budget_bytes}; it must be >= 0 (0 turns the host tier off)")
        self.budget_bytes = budget_bytes
        self.rule, self.saved_flops, self.branches, self.reachable = rule, saved_flops, branches, reachable
        self.flop_weight = flop_weight
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self.used_bytes = 0     # the entries'
        self.swapped: dict = {}  # request id -> the bytes its swapped-out memory holds here
        self.swap_bytes = 0
        self.kv = None  # the host KV tier (memory/host_kv_tier.py) sharing the budget: it gives way to states and swaps
        self.pins = pins if pins is not None else StatePins()
        # the prefix tree, for an output state's edge (memory/kinds.py sets both): the hash of the
        # block before the block keyed `key` (None: unknown), and whether a device checkpoint has a key
        self.parent_of: Callable[[bytes], Optional[bytes]] = lambda key: None
        self.on_device: Callable[[bytes], bool] = lambda key: False
        self.block_size = 1
        self.counters = TierCounters()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    # ---- demotion ----------------------------------------------------------------------------
    def _worth(self, key: bytes, position: int, output: bool) -> int:
        """An output state's tokens since the nearest state kept before it (here or on the device)
        on its path, found by walking the prefix tree's parents; any other state's position."""
        if not output:
            return position
        p, k = position, key
        while p > 0 and (k := self.parent_of(k)) is not None:
            p -= self.block_size
            if k in self.entries or self.on_device(k):
                return position - p
        return position

    def _rank(self, keys: list[bytes], worth: list[int]) -> int:
        """The index of the rule's victim among `keys` (least recently used first), their worths in tokens."""
        branches = [self.branches(k) for k in keys]
        return choose_victim(self.rule, worth, self.saved_flops, HOST_FLOP_SCALE * self.flop_weight, branches=branches,
                             passed_penalty=0.0)

    def _victims(self, key: bytes, worth: int, last_used: int, nbytes: int) -> Optional[list[bytes]]:
        """The entries to evict so that the state keyed `key`, of `nbytes` worth `worth` tokens, fits,
        or None when it is not worth its bytes (the rule would evict it first, or it exceeds the budget),
        or, pinned, when it does not fit beside the pinned entries (never refused by the rule)."""
        # unpinned KV entries' bytes count as free: they give way
        free = self.budget_bytes - self.swap_bytes - self.used_bytes - self._kv_pinned_bytes()
        if nbytes > free + self.used_bytes:
            return None
        gone = [k for k in self.entries if not self.reachable(k)]  # useless: their KV is gone
        free += sum(self.entries[k].nbytes for k in gone)
        if free >= nbytes:
            return gone
        pinned = self.pins.pinned(key)
        # the candidate itself (`key`), ranked with the others by when it was last used
        rest = sorted([k for k in self.entries if k not in gone and not self.pins.pinned(k)] + [key],
                      key=lambda k: last_used if k is key else self.entries[k].last_used)
        while free < nbytes:
            if len(rest) == 1:  # only the candidate is left: the pins stay, it is not kept
                return None
            if pinned:  # a pinned newcomer takes the rule's victim among the others
                rest.remove(key)
                i = self._rank(rest, [self.entries[k].worth for k in rest])
                rest.append(key)
            else:
                i = self._rank(rest, [worth if k is key else self.entries[k].worth for k in rest])
            if rest[i] is key:
                return None
            free += self.entries[rest[i]].nbytes
            gone.append(rest.pop(i))
        return gone

    def worth(self, key: bytes, position: int, last_used: int, nbytes: int, output: bool = False) -> bool:
        """Whether put() would keep a state of these bytes now (no change; to skip a useless copy)."""
        return self._victims(key, self._worth(key, position, output), last_used, nbytes) is not None

    def put(self, key: bytes, position: int, last_used: int, conv: dict, ssm: dict, output: bool = False) -> bool:
        """Keep a host copy (tensors on the host, owned by the tier from now) under `key`,
        evicting entries for room; False (nothing changed) when it is not worth its bytes.
        output: a state inside a request's generated tokens (its worth is its edge)."""
        if key in self.entries:
            raise RuntimeError("a state demoted twice under one key: a key is never in two tiers")
        nbytes = sum(t.numel() * t.element_size() for part in (conv, ssm) for t in part.values())
        worth = self._worth(key, position, output)
        victims = self._victims(key, worth, last_used, nbytes)
        if victims is None:
            self.refused(key)
            return False
        for k in victims:
            self._evict(k)
        self._kv_gives_way(nbytes)
        layout = {(p, i): (tuple(t.shape), t.dtype) for p, part in (("conv", conv), ("ssm", ssm))
                  for i, t in part.items()}
        self.entries[key] = HostEntry(key, position, last_used, conv, ssm, layout, checksum(conv, ssm), nbytes, worth)
        self.entries.move_to_end(key)
        self.used_bytes += nbytes
        self.counters.demotions += 1
        self.counters.pinned_demotions += self.pins.pinned(key)
        return True

    def refused(self, key: bytes) -> None:
        """Count a demotion of the state keyed `key` not kept here (the device drops it)."""
        self.counters.refused_demotions += 1
        self.counters.refused_pinned += self.pins.pinned(key)

    # ---- swap --------------------------------------------------------------------------------
    def hold(self, rid, nbytes: int) -> bool:
        """Make room for request rid's swapped-out memory (`nbytes`), evicting entries by the rule
        (unreachable ones first); False, changing nothing, when it would not fit with none left."""
        if rid in self.swapped:
            raise RuntimeError(f"request {rid!r} swapped out twice without coming back")
        if nbytes > self.budget_bytes - self.swap_bytes:
            self.counters.swaps_refused += 1
            return False
        self._kv_gives_way(nbytes)
        while self.budget_bytes - self.swap_bytes - self.used_bytes - self._kv_bytes() < nbytes:
            keys = sorted(self.entries, key=lambda k: self.entries[k].last_used)
            gone = [k for k in keys if not self.reachable(k)]
            unpinned = [k for k in keys if not self.pins.pinned(k)]
            if not keys:  # only pinned KV entries left: a running request's memory takes them (counted)
                self.kv.shrink(nbytes - (self.budget_bytes - self.swap_bytes - self.used_bytes - self._kv_bytes()),
                               pinned_too=True)
                break
            if gone:
                victim = gone[0]
            elif unpinned:  # the rule's victim among the unpinned entries (least recently used first on ties)
                victim = unpinned[self._rank(unpinned, [self.entries[k].worth for k in unpinned])]
            else:  # only pins left: a running request's memory takes one (its pin lost, counted)
                victim = keys[0]
            self._evict(victim)
        self.swapped[rid] = nbytes
        self.swap_bytes += nbytes
        return True

    def _kv_bytes(self) -> int:
        return self.kv.used_bytes if self.kv is not None else 0

    def _kv_pinned_bytes(self) -> int:
        return self.kv.pinned_bytes() if self.kv is not None else 0

    def _kv_gives_way(self, nbytes: int) -> None:
        """Evict host KV entries until `nbytes` fit beside the states and swaps (or no KV is left)."""
        if self.kv is not None:
            self.kv.shrink(nbytes - (self.budget_bytes - self.swap_bytes - self.used_bytes - self.kv.used_bytes))

    def let_go(self, rid) -> None:
        """Request rid's swapped memory left the host (swapped back in, or it ended)."""
        self.swap_bytes -= self.swapped.pop(rid, 0)

    # ---- use ---------------------------------------------------------------------------------
    def usable(self, key: bytes, position: int) -> bool:
        """Whether the entry under `key` exists and passes the check (key, position, layout,
        CRC-32); one that fails is dropped and counted, and False returned."""
        e = self.entries.get(key)
        if e is None:
            return False
        layout = {(p, i): (tuple(t.shape), t.dtype) for p, part in (("conv", e.conv), ("ssm", e.ssm))
                  for i, t in part.items()}
        if e.key != key or e.position != position or layout != e.layout or checksum(e.conv, e.ssm) != e.crc:
            self._remove(key)
            self.pins.left(key)
            self.counters.refused_corrupt += 1
            return False
        return True

    def promote(self, key: bytes, clock: int) -> tuple[dict, dict]:
        """The entry's (conv, ssm) to copy into a device slot (checked by usable() in the same
        admission); the entry stays and becomes the most recently used."""
        e = self.entries[key]
        e.last_used = clock
        self.entries.move_to_end(key)
        self.counters.hits += 1
        self.counters.promotions += 1
        return e.conv, e.ssm

    def discard(self, key: bytes) -> None:
        """Forget the host copy under `key` (a device checkpoint now holds that state, a pin with it;
        or the caller drops the state from every tier)."""
        if key in self.entries:
            self._remove(key)

    def _evict(self, key: bytes) -> None:
        """Drop the entry under `key` for room (or unreachable): its state leaves every tier."""
        self._remove(key)
        self.pins.left(key)
        self.counters.evictions += 1

    def _remove(self, key: bytes) -> None:
        self.used_bytes -= self.entries.pop(key).nbytes

    def stats(self) -> dict:
        c = self.counters
        return {"entries": len(self.entries), "bytes": self.used_bytes, "budget_bytes": self.budget_bytes,
                "hits": c.hits, "promotions": c.promotions, "demotions": c.demotions,
                "refused_demotions": c.refused_demotions, "evictions": c.evictions,
                "refused_corrupt": c.refused_corrupt, "promotion_seconds": c.promotion_seconds,
                "swap_bytes": self.swap_bytes, "swaps_refused": c.swaps_refused,
                "pinned_entries": self.pins.live(self.entries.__contains__), "pinned_demotions": c.pinned_demotions,
                "refused_pinned": c.refused_pinned}
