"""Recurrent state: one live slot per running request, and immutable checkpoints for prefix hits.

A recurrent layer's state after p tokens summarises the whole prefix, so it exists only at the
positions where a request's chunk ended. The kind keeps (a) one live slot per running request,
written in place by the kernels, and (b) checkpoints: copies of a live state at a block boundary,
keyed by the hash of the block ending there, never written again. A hit copies the checkpoint
into a fresh live slot (copy-on-hit). When slots run short, checkpoints are evicted:
unreachable ones first (the attention KV before them is gone), then by the eviction rule.
An output checkpoint (only a continuation of that answer can use it) displaces only output
checkpoints; each request keeps one, rolling forward. A draft of k tokens holds k + 1 free slots
for a step; accepting j makes slot j - 1 the live one (`accept_draft`). A host tier (memory/
host_tier.py) keeps evicted states worth their bytes there, seen by matches, promoted on a hit. A
pinned turn's state (`pin`, memory/state_pins.py) leaves the device only for a live or draft slot
or unreachable; evicted, it is demoted to the host still pinned (its pin is lost, counted, only
when no tier keeps it).
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional, Sequence

import torch

from hybridkv.errors import SnapshotMismatchError
from hybridkv.eviction import check_rule, choose_victim
from hybridkv.specs import RecurrentSpec
from hybridkv.state_pool import CHECKPOINT, DRAFT, LIVE, StatePool

from .host_tier import HostStateTier
from .layer_memory import LayerMemory
from .state_pins import StatePins


@dataclass
class Checkpoint:
    slot: int
    position: int
    last_used: int
    output: bool = False  # a state inside a request's generated tokens
    from_disk: bool = False  # loaded by the disk tier and not hit since (its first hit is the disk's)


class RecurrentMemory(LayerMemory):
    """conv[layer]: [num_slots, *conv_shape]; ssm[layer]: [num_slots, *state_shape]; slot 0 is null.

    reachable(h): whether the attention kinds still hold the KV a checkpoint keyed h needs.
    saved_flops(p): prefill FLOPs a checkpoint at position p saves (for the 'flop' eviction rule).
    draft_reserve: free slots a checkpoint never takes (speculative decoding's draft slots).
    host_cache_bytes: the host tier's budget (0: no host tier; evicted checkpoints are dropped).
    """

    name = "recurrent"

    @staticmethod
    def handles(spec) -> bool:
        return isinstance(spec, RecurrentSpec)

    def __init__(self, layers: Mapping[int, RecurrentSpec], block_size: int, num_slots: int,
                 device: torch.device | str = "cpu", eviction: str = "lru",
                 saved_flops: Optional[Callable[[int], float]] = None,
                 reachable: Callable[[bytes], bool] = lambda h: True, flop_weight: float = 1.0,
                 branches: Callable[[bytes], int] = lambda h: 0, draft_reserve: int = 0,
                 host_cache_bytes: int = 0):
        super().__init__(layers, block_size)
        check_rule(eviction)
        self.states = StatePool(self.layers, num_slots, device)
        self.eviction = eviction
        self.saved_flops = saved_flops or (lambda p: float(p))
        self.flop_weight = flop_weight
        self.reachable = reachable
        self.branches = branches
        self.draft_reserve = draft_reserve
        self.checkpoints: OrderedDict[bytes, Checkpoint] = OrderedDict()  # least recently used first
        self._slot: dict[Hashable, int] = {}
        self._rolling: dict[Hashable, bytes] = {}  # rid -> key of its output checkpoint
        self._draft: dict[Hashable, list[int]] = {}  # rid -> its draft slots while it verifies a draft
        self._clock = 0
        self.pins = StatePins()  # pinned turns' states (prefix_cache.pin), in whichever tier holds them
        self.host: Optional[HostStateTier] = None
        if host_cache_bytes:
            self.host = HostStateTier(host_cache_bytes, eviction, self.saved_flops, branches, reachable, flop_weight,
                                      pins=self.pins)
        self._slot_bytes = sum(t[0].numel() * t.element_size() for t in self.states._tensors())
        self.device_counts = {"hits": 0, "evictions": 0}  # the device tier's (the host's: host.counters)
        self.disk_hits = 0  # admissions that used a checkpoint the disk tier loaded (memory/disk_tier.py)

    @property
    def num_slots(self) -> int:
        return self.states.num_slots

    def live_slot(self, rid: Hashable) -> int:
        return self._slot.get(rid, 0)

    def live_slots(self, rids: Sequence[Hashable]) -> list[int]:
        return list(map(self._slot.get, rids, itertools.repeat(0)))

    # ---- checkpoints -----------------------------------------------------------------------
    def _touch(self, h: bytes) -> None:
        self._clock += 1
        self.checkpoints[h].last_used = self._clock
        self.checkpoints.move_to_end(h)

    def _add(self, h: bytes, position: int, slot: int, output: bool = False) -> None:
        self._clock += 1
        self.checkpoints[h] = Checkpoint(slot, position, self._clock, output)
        if self.host is not None:  # a key is never in two tiers: the device copy supersedes
            self.host.discard(h)

    def _drop(self, h: bytes) -> None:
        """Free the device checkpoint keyed h; its state leaves every tier (a demotion comes first)."""
        self.states.free(self.checkpoints.pop(h).slot)
        self.pins.left(h)

    def _take_slot(self, kind: str, protect: Optional[bytes] = None, only_output: bool = False) -> Optional[int]:
        """A free slot marked `kind`, evicting checkpoints (unreachable first, then by the rule)
        if needed; never the one keyed `protect`. None when none can be freed. A checkpoint never
        takes one of the last `draft_reserve` free slots (less those drafts hold now). only_output
        (an output state asks): only output checkpoints may go, unless the host tier keeps the
        victim (then it is demoted, not lost)."""
        keep = max(0, self.draft_reserve - sum(map(len, self._draft.values()))) if kind == CHECKPOINT else 0
        if self.states.num_free > keep or not self.checkpoints:
            return self.states.allocate(kind) if self.states.num_free > keep else None
        for h in [h for h in self.checkpoints if h != protect and not self.reachable(h)]:
            self._drop(h)
        if self.states.num_free <= keep:
            victim = None
            if not only_output or self.host is not None:
                victim = self._victim([h for h in self.checkpoints if h != protect], for_live=kind != CHECKPOINT)
            if only_output and (victim is None or not self.checkpoints[victim].output and not self.host.worth(
                    victim, self.checkpoints[victim].position, self.checkpoints[victim].last_used, self._slot_bytes)):
                victim = self._victim([h for h, c in self.checkpoints.items() if h != protect and c.output])
            if victim is not None:
                self._evict(victim)
        return self.states.allocate(kind) if self.states.num_free > keep else None

    def pin(self, h: bytes, until: float) -> None:
        """Keep the checkpoint keyed h (kept now or by the release that follows) until monotonic `until`."""
        self.pins.pin(h, until)

    def _victim(self, keys: list[bytes], for_live: bool = False) -> Optional[bytes]:
        """The checkpoint the eviction rule gives up first among `keys` (least recently used first),
        unpinned while one is; a pinned one only `for_live` (a running request needs the slot: the
        pinned state leaves the device, demoted to the host tier with its pin when it keeps it)."""
        if self.pins and keys:
            self.pins.expire()
            unpinned = [h for h in keys if h not in self.pins]
            if not unpinned and not for_live:
                return None
            keys = unpinned or keys
        return self._victim_by_rule(keys)

    def _victim_by_rule(self, keys: list[bytes]) -> Optional[bytes]:
        if not keys:
            return None
        i = choose_victim(self.eviction, [self.checkpoints[h].position for h in keys], self.saved_flops,
                          self.flop_weight, branches=[self.branches(h) for h in keys])
        return keys[i]

    def _evict(self, h: bytes) -> None:
        """Evict the checkpoint keyed h from the device for room: demoted to the host tier (a
        pinned one with its pin) when the host keeps it, else dropped (a pin lost, counted)."""
        self.device_counts["evictions"] += 1
        if self._demote(h):
            self.states.free(self.checkpoints.pop(h).slot)
        else:
            self._drop(h)

    def _demote(self, h: bytes) -> bool:
        """Copy the checkpoint keyed h to the host tier if it keeps it (worth its bytes there, or
        pinned and room left beside the host's pins); True when it did. The caller then removes it
        from the device: a key is never in two tiers."""
        c, host = self.checkpoints[h], self.host
        if host is not None and host.worth(h, c.position, c.last_used, self._slot_bytes, c.output):
            conv, ssm = self.states.to_host(c.slot, "cpu", pin=any(t.is_cuda for t in self.states._tensors()))
            return host.put(h, c.position, c.last_used, conv, ssm, c.output)
        if host is not None:
            host.refused(h)  # counted there
        return False

    def _can_take_slot(self) -> bool:
        return self.states.num_free > 0 or bool(self.checkpoints)

    def checkpoint(self, rid: Hashable, h: bytes, position: int, output: bool, source: Optional[int] = None) -> bool:
        src = self._slot[rid] if source is None else source
        if output:  # one rolling output state per request, in every tier: the new one replaces the
            old = self._rolling.get(rid)  # old, unless a pinned turn (a twin that ended) pinned it
            self._rolling[rid] = h
            if old is not None and old != h and not self.pins.pinned(old):
                if old not in self.checkpoints:  # demoted (or dropped): it leaves the host tier too
                    if self.host is not None and old in self.host:
                        self.host.discard(old)
                        self.pins.left(old)  # (a pin past its deadline, if any)
                elif h not in self.checkpoints:
                    # the new state takes the old one's slot in place: what freeing it and taking a
                    # slot would do (the free list hands the slot just freed back first)
                    c = self.checkpoints.pop(old)
                    self.pins.left(old)  # (a pin past its deadline, if any)
                    self.states.copy(src, c.slot)
                    self._clock += 1
                    c.position, c.last_used, c.output = position, self._clock, True
                    self.checkpoints[h] = c
                    if self.host is not None:
                        self.host.discard(h)
                    return True
                else:
                    self._drop(old)
        if h in self.checkpoints:
            self._touch(h)
            return False
        slot = self._take_slot(CHECKPOINT, only_output=output)
        if slot is None:
            return False
        self.states.copy(src, slot)
        self._add(h, position, slot, output)
        return True

    def adopt(self, h: bytes, position: int, conv: Mapping[int, torch.Tensor],
              ssm: Mapping[int, torch.Tensor], charge=None) -> bool:
        """Make a state loaded from the disk tier (host tensors, verified) the checkpoint keyed h,
        in a slot taken as any checkpoint takes one; False (nothing changed) when none can be freed.
        Its first hit counts as the disk tier's. `charge`: as StatePool.from_host's."""
        if h in self.checkpoints:
            self._touch(h)
            return True
        slot = self._take_slot(CHECKPOINT)
        if slot is None:
            return False
        self.states.from_host(slot, conv, ssm, charge)
        self._add(h, position, slot)
        self.checkpoints[h].from_disk = True
        return True

    def invalidate(self, h: bytes) -> bool:
        """Drop the checkpoint keyed h from the device and the host tier (never demoted: it is
        wrong); False when neither held it."""
        held = h in self.checkpoints or (self.host is not None and h in self.host)
        if h in self.checkpoints:
            self._drop(h)
        if self.host is not None:
            self.host.discard(h)
        self.pins.left(h)  # (held by neither tier now: a pin on it is lost, counted)
        return held

    # ---- drafts (speculative decoding) -----------------------------------------------------
    def can_take_draft_slots(self, n: int) -> bool:
        return self.states.num_free >= n

    def take_draft_slots(self, rid: Hashable, n: int) -> list[int]:
        """n free slots for the states after each token of rid's draft run (call
        can_take_draft_slots first); they are rid's until accept_draft or release."""
        if rid in self._draft:
            raise RuntimeError(f"request {rid!r} already holds draft slots")
        if not self.can_take_draft_slots(n):
            raise RuntimeError(f"take_draft_slots for {rid!r} without {n} free slots: ask can_take_draft_slots")
        self._draft[rid] = slots = [self.states.allocate(DRAFT) for _ in range(n)]
        return slots

    def draft_slots(self, rid: Hashable) -> list[int]:
        return self._draft.get(rid, [])

    def accept_draft(self, rid: Hashable, num_tokens: int) -> None:
        """The first num_tokens tokens of rid's run are kept: the state after the last of them
        becomes rid's live state (a slot move, no copy); the old live slot and the other draft
        slots are freed. 0: none is kept, the live slot stays and every draft slot is freed."""
        slots = self._draft.pop(rid, [])
        kept = slots[num_tokens - 1] if num_tokens else self._slot[rid]
        if num_tokens:
            self.states.free(self._slot[rid])
            self.states.mark(kept, LIVE)
            self._slot[rid] = kept
        for s in (s for s in slots if s != kept):
            self.states.free(s)

    def _drop_draft(self, rid: Hashable) -> None:
        for s in self._draft.pop(rid, ()):
            self.states.free(s)

    # ---- prefix reuse ----------------------------------------------------------------------
    def usable_prefix(self, hashes: Sequence[bytes], limit: int) -> int:
        m = min(limit, len(hashes))
        while m > 0 and hashes[m - 1] not in self.checkpoints and not (
                self.host is not None and self.host.usable(hashes[m - 1], m * self.block_size)):
            m -= 1  # a host entry counts once its check passes (a failing one is dropped)
        return m

    # ---- admission -------------------------------------------------------------------------
    def can_admit(self, hashes: Sequence[bytes], hit: int, end: int) -> bool:
        return self._can_take_slot()

    def admit(self, rid: Hashable, hashes: Sequence[bytes], hit: int) -> None:
        if not hit:
            self._slot[rid] = self._take_slot(LIVE)
            return
        key = hashes[hit - 1]
        if key not in self.checkpoints:  # a host-tier hit (the match checked it): promote it
            self._clock += 1
            conv, ssm = self.host.promote(key, self._clock)
            self._slot[rid] = slot = self._take_slot(LIVE)
            t0 = time.perf_counter()
            self.states.from_host(slot, conv, ssm, self._charge_host)
            self.host.counters.promotion_seconds += time.perf_counter() - t0
            return
        src = self.checkpoints[key]
        if src.from_disk:
            self.disk_hits += 1
            src.from_disk = False
        else:
            self.device_counts["hits"] += 1
        slot = self._take_slot(LIVE, protect=key)
        if slot is None:  # the hit's checkpoint is the only slot left: it becomes the live slot
            kept = self._demote(key)  # a host copy stays findable (a pin with it), when the host keeps it
            del self.checkpoints[key]
            if not kept:
                self.pins.left(key)  # (a pin on it gave way to the live slot, counted, as in _evict)
            self.states.mark(src.slot, LIVE)
            self._slot[rid] = src.slot
            return
        self._touch(key)
        self.states.copy(src.slot, slot)
        self._slot[rid] = slot

    def _charge_host(self, seconds: float) -> None:  # a promotion's writes, run layer by layer
        self.host.counters.promotion_seconds += seconds

    # ---- a request's life ------------------------------------------------------------------
    def can_fork(self) -> bool:
        return self._can_take_slot()

    def fork(self, parent: Hashable, child: Hashable, num_computed: int) -> None:
        slot = self._take_slot(LIVE)
        self.states.copy(self._slot[parent], slot)
        self._slot[child] = slot

    def release(self, rid: Hashable, donate: Optional[tuple[bytes, int]] = None) -> None:
        self._drop_draft(rid)
        slot = self._slot.pop(rid, 0)
        if slot and donate is not None and donate[0] not in self.checkpoints:  # the live state becomes it, no copy
            self.states.mark(slot, CHECKPOINT)
            self._add(donate[0], donate[1], slot)
            return
        if slot:
            self.states.free(slot)
        if donate is not None and donate[0] not in self.checkpoints and not (
                self.host is not None and donate[0] in self.host):
            self.pins.never_kept(donate[0])  # no live state to keep (swapped out): a pin on it holds nothing

    def forget(self, rid: Hashable) -> None:
        h = self._rolling.pop(rid, None)
        if h in self.checkpoints:
            # only a continuation of this exact answer (the next turn of a chat) reuses it:
            # first to go when slots are short, unless it is hit before
            self.checkpoints.move_to_end(h, last=False)

    def swap_bytes(self, rid: Hashable, num_computed: int) -> int:
        return self._slot_bytes

    def swap_out(self, rid: Hashable, num_computed: int) -> dict:
        slot = self._slot[rid]
        pin = any(t.is_cuda for t in self.states._tensors())
        conv, ssm = self.states.to_host(slot, "cpu", pin)
        self.release(rid)
        return {"conv": conv, "ssm": ssm}

    def can_swap_in(self, copy: dict, end: int) -> bool:
        return self._can_take_slot()

    def swap_in(self, rid: Hashable, copy: dict, hashes: Sequence[bytes], num_computed: int) -> None:
        self._slot[rid] = slot = self._take_slot(LIVE)
        self.states.from_host(slot, copy["conv"], copy["ssm"])

    def export(self, rid: Hashable, num_computed: int, device: torch.device | str) -> dict:
        conv, ssm = self.states.to_host(self._slot[rid], device)
        return {"conv": conv, "ssm": ssm}

    def check_import(self, part: dict, num_computed: int) -> None:
        for field, tensors, stored, layout_of in (
                ("conv", self.states.conv, RecurrentSpec.stored_conv, lambda s: s.conv_layout),
                ("ssm", self.states.ssm, RecurrentSpec.stored_ssm, lambda s: s.ssm_layout)):
            for i in tensors:
                spec, t = self.layers[i], part.get(field, {}).get(i)
                if t is None:
                    raise SnapshotMismatchError(f"snapshot has no {field} state for recurrent layer {i}")
                shape, dtype = stored(spec)
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise SnapshotMismatchError(
                        f"snapshot {field} state of layer {i} is {tuple(t.shape)} {t.dtype}; expected {shape} {dtype}")
                layout = layout_of(spec)
                if not bool(torch.isfinite(t if layout is None else layout.decode(t)).all()):
                    raise SnapshotMismatchError(f"snapshot {field} state of layer {i} holds NaN or infinite values")

    def can_import(self, part: dict, num_computed: int, end: int) -> bool:
        return self._can_take_slot()

    def import_(self, rid: Hashable, part: dict, hashes: Sequence[bytes], num_computed: int) -> None:
        self.swap_in(rid, part, hashes, num_computed)

    def layer_shapes(self) -> dict[int, tuple]:
        return {i: ("rec", tuple(s.conv_shape), tuple(s.state_shape), str(s.dtype), str(s.ssm_dtype))
                + (("cache", s.cache_dtype) if s.cache_dtype else ()) for i, s in self.layers.items()}

    def stats(self) -> dict:
        st = self.states
        n = st.count(CHECKPOINT)
        tiers = {"device": {"entries": n, "bytes": n * self._slot_bytes, **self.device_counts}}
        if self.host is not None:
            tiers["host"] = self.host.stats()
        return {"slots_live": st.count(LIVE), "slots_checkpoint": n,
                "slots_free": st.num_free, "slots_total": max(0, st.num_slots - 1), "tiers": tiers}
