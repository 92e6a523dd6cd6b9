"""The device's checkpoints of recurrent state: immutable copies kept for prefix hits, and eviction.

A checkpoint is a copy of a live state at a block boundary, keyed by the hash of the block ending
there, never written again; it holds one slot of the StatePool the recurrent kind
(memory/recurrent.py) shares with its live and draft slots. This file owns the checkpoints in
that pool: adding and touching them (one clock, least recently used first), taking a slot for
any use by evicting checkpoints (unreachable ones first, whose attention KV is gone, then by the
eviction rule), and the device tier's counters. An output checkpoint (only a continuation of that
answer can use it) displaces only output checkpoints; each request keeps one, rolling forward. A
checkpoint never takes one of the slots reserved for drafts. A host tier (memory/host_tier.py)
keeps evicted states worth their bytes there (demotion). A pinned turn's state (memory/
state_pins.py) leaves the device only for a live or draft slot or unreachable; evicted, it is
demoted to the host still pinned (its pin is lost, counted, only when no tier keeps it). States
the disk tier loads are adopted here (`adopt`); a wrong one is dropped from every tier
(`invalidate`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional

import torch

from hybridkv.eviction import choose_victim
from hybridkv.state_pool import CHECKPOINT, StatePool

from .host_tier import HostStateTier
from .state_pins import StatePins


@dataclass
class Checkpoint:
    slot: int
    position: int
    last_used: int
    output: bool = False  # a state inside a request's generated tokens
    from_disk: bool = False  # loaded by the disk tier and not hit since (its first hit is the disk's)


class StateCheckpoints:
    """The checkpoints kept in `states` (a StatePool whose other slots are live or draft).

    eviction, saved_flops(p), flop_weight, branches(h): the eviction rule and its inputs.
    reachable(h): whether the attention kinds still hold the KV a checkpoint keyed h needs.
    draft_reserve: free slots a checkpoint never takes, less `drafts_held()` (slots drafts hold now).
    host_cache_bytes: the host tier's budget (0: no host tier; evicted checkpoints are dropped).
    """

    def __init__(self, states: StatePool, eviction: str, saved_flops: Callable[[int], float],
                 reachable: Callable[[bytes], bool], flop_weight: float, branches: Callable[[bytes], int],
                 draft_reserve: int, drafts_held: Callable[[], int], host_cache_bytes: int):
        self.states = states
        self.eviction = eviction
        self.saved_flops = saved_flops
        self.flop_weight = flop_weight
        self.reachable = reachable
        self.branches = branches
        self.draft_reserve = draft_reserve
        self.drafts_held = drafts_held
        self.checkpoints: OrderedDict[bytes, Checkpoint] = OrderedDict()  # least recently used first
        self.rolling: dict[Hashable, bytes] = {}  # rid -> key of its output checkpoint
        self.clock = 0
        self.pins = StatePins()  # pinned turns' states (prefix_cache.pin), in whichever tier holds them
        self.host: Optional[HostStateTier] = None
        if host_cache_bytes:
            self.host = HostStateTier(host_cache_bytes, eviction, saved_flops, branches, reachable, flop_weight,
                                      pins=self.pins)
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in states._tensors())
        self.device_counts = {"hits": 0, "evictions": 0}  # the device tier's (the host's: host.counters)
        self.disk_hits = 0  # admissions that used a checkpoint the disk tier loaded (memory/disk_tier.py)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, h: bytes) -> None:
        self.checkpoints[h].last_used = self.tick()
        self.checkpoints.move_to_end(h)

    def add(self, h: bytes, position: int, slot: int, output: bool = False) -> None:
        """Make `slot` (marked CHECKPOINT, holding the state) the checkpoint keyed h."""
        self.checkpoints[h] = Checkpoint(slot, position, self.tick(), output)
        if self.host is not None:  # a key is never in two tiers: the device copy supersedes
            self.host.discard(h)

    def drop(self, h: bytes) -> None:
        """Free the device checkpoint keyed h; its state leaves every tier (a demotion comes first)."""
        self.states.free(self.checkpoints.pop(h).slot)
        self.pins.left(h)

    def holds(self, h: bytes) -> bool:
        """Whether the device or the host tier keeps a state keyed h."""
        return h in self.checkpoints or (self.host is not None and h in self.host)

    def hit(self, h: bytes) -> Checkpoint:
        """The checkpoint keyed h, an admission's hit: counted as the device's, or the disk's first."""
        c = self.checkpoints[h]
        if c.from_disk:
            self.disk_hits += 1
            c.from_disk = False
        else:
            self.device_counts["hits"] += 1
        return c

    def hand_over(self, h: bytes) -> int:
        """The slot of the checkpoint keyed h, no longer a checkpoint (the caller's to mark): a hit
        whose checkpoint is the only slot left. A host copy stays findable (a pin with it) when
        the host keeps it."""
        kept = self.demote(h)
        c = self.checkpoints.pop(h)
        if not kept:
            self.pins.left(h)  # (a pin on it gave way to the live slot, counted, as in evict)
        return c.slot

    def can_take_slot(self) -> bool:
        return self.states.num_free > 0 or bool(self.checkpoints)

    def take_slot(self, kind: str, protect: Optional[bytes] = None, only_output: bool = False) -> Optional[int]:
        """A free slot marked `kind`, evicting checkpoints (unreachable first, then by the rule)
        if needed; never the one keyed `protect`. None when none can be freed. A checkpoint never
        takes one of the last `draft_reserve` free slots (less those drafts hold now). only_output
        (an output state asks): only output checkpoints may go, unless the host tier keeps the
        victim (then it is demoted, not lost)."""
        keep = max(0, self.draft_reserve - self.drafts_held()) if kind == CHECKPOINT else 0
        if self.states.num_free > keep or not self.checkpoints:
            return self.states.allocate(kind) if self.states.num_free > keep else None
        for h in [h for h in self.checkpoints if h != protect and not self.reachable(h)]:
            self.drop(h)
        if self.states.num_free <= keep:
            victim = None
            if not only_output or self.host is not None:
                victim = self.victim([h for h in self.checkpoints if h != protect], for_live=kind != CHECKPOINT)
            if only_output and (victim is None or not self.checkpoints[victim].output and not self.host.worth(
                    victim, self.checkpoints[victim].position, self.checkpoints[victim].last_used, self.slot_bytes)):
                victim = self.victim([h for h, c in self.checkpoints.items() if h != protect and c.output])
            if victim is not None:
                self.evict(victim)
        return self.states.allocate(kind) if self.states.num_free > keep else None

    def victim(self, keys: list[bytes], for_live: bool = False) -> Optional[bytes]:
        """The checkpoint the eviction rule gives up first among `keys` (least recently used first),
        unpinned while one is; a pinned one only `for_live` (a running request needs the slot: the
        pinned state leaves the device, demoted to the host tier with its pin when it keeps it)."""
        if self.pins and keys:
            self.pins.expire()
            unpinned = [h for h in keys if h not in self.pins]
            if not unpinned and not for_live:
                return None
            keys = unpinned or keys
        if not keys:
            return None
        i = choose_victim(self.eviction, [self.checkpoints[h].position for h in keys], self.saved_flops,
                          self.flop_weight, branches=[self.branches(h) for h in keys])
        return keys[i]

    def evict(self, h: bytes) -> None:
        """Evict the checkpoint keyed h from the device for room: demoted to the host tier (a
        pinned one with its pin) when the host keeps it, else dropped (a pin lost, counted)."""
        self.device_counts["evictions"] += 1
        if self.demote(h):
            self.states.free(self.checkpoints.pop(h).slot)
        else:
            self.drop(h)

    def demote(self, h: bytes) -> bool:
        """Copy the checkpoint keyed h to the host tier if it keeps it (worth its bytes there, or
        pinned and room left beside the host's pins); True when it did. The caller then removes it
        from the device: a key is never in two tiers."""
        c, host = self.checkpoints[h], self.host
        if host is not None and host.worth(h, c.position, c.last_used, self.slot_bytes, c.output):
            conv, ssm = self.states.to_host(c.slot, "cpu", pin=any(t.is_cuda for t in self.states._tensors()))
            return host.put(h, c.position, c.last_used, conv, ssm, c.output)
        if host is not None:
            host.refused(h)  # counted there
        return False

    def checkpoint(self, rid: Hashable, h: bytes, position: int, output: bool, src: int) -> bool:
        """Keep the state in slot `src` (rid's) as the checkpoint keyed h at `position`; an output
        one becomes rid's rolling output state. True when a new checkpoint was written."""
        if output:  # one rolling output state per request, in every tier: the new one replaces the
            old = self.rolling.get(rid)  # old, unless a pinned turn (a twin that ended) pinned it
            self.rolling[rid] = h
            if old is not None and old != h and not self.pins.pinned(old) \
                    and self._replace_rolling(old, h, position, src):
                return True
        if h in self.checkpoints:
            self.touch(h)
            return False
        slot = self.take_slot(CHECKPOINT, only_output=output)
        if slot is None:
            return False
        self.states.copy(src, slot)
        self.add(h, position, slot, output)
        return True

    def _replace_rolling(self, old: bytes, h: bytes, position: int, src: int) -> bool:
        """A request's previous rolling output state `old` leaves every tier for the new one keyed h:
        the host tier's copy if it was demoted there; else its device slot, which the new state takes
        in place when h is new (what freeing it and taking a slot would do: the free list hands the
        slot just freed back first). True when the new state was written so."""
        if old not in self.checkpoints:
            if self.host is not None and old in self.host:
                self.host.discard(old)
                self.pins.left(old)  # (a pin past its deadline, if any)
            return False
        if h in self.checkpoints:
            self.drop(old)
            return False
        slot = self.checkpoints.pop(old).slot
        self.pins.left(old)  # (a pin past its deadline, if any)
        self.states.copy(src, slot)
        self.add(h, position, slot, True)
        return True

    def forget(self, rid: Hashable) -> None:
        """rid has ended for good: its rolling output state is the first to go when slots are short."""
        h = self.rolling.pop(rid, None)
        if h in self.checkpoints:
            # only a continuation of this exact answer (the next turn of a chat) reuses it:
            # first to go when slots are short, unless it is hit before
            self.checkpoints.move_to_end(h, last=False)

    def adopt(self, h: bytes, position: int, conv: Mapping[int, torch.Tensor],
              ssm: Mapping[int, torch.Tensor], charge=None) -> bool:
        """Make a state loaded from the disk tier (host tensors, verified) the checkpoint keyed h,
        in a slot taken as any checkpoint takes one; False (nothing changed) when none can be freed.
        Its first hit counts as the disk tier's. `charge`: as StatePool.from_host's."""
        if h in self.checkpoints:
            self.touch(h)
            return True
        slot = self.take_slot(CHECKPOINT)
        if slot is None:
            return False
        self.states.from_host(slot, conv, ssm, charge)
        self.add(h, position, slot)
        self.checkpoints[h].from_disk = True
        return True

    def invalidate(self, h: bytes) -> bool:
        """Drop the checkpoint keyed h from the device and the host tier (never demoted: it is
        wrong); False when neither held it."""
        held = self.holds(h)
        if h in self.checkpoints:
            self.drop(h)
        if self.host is not None:
            self.host.discard(h)
        self.pins.left(h)  # (held by neither tier now: a pin on it is lost, counted)
        return held
