"""Recurrent state: the kind of layer memory for RecurrentSpec layers, one live slot per running request.

A recurrent layer's state after p tokens summarises the whole prefix, so it exists only at the
positions where a request's chunk ended. The kind keeps one live slot per running request in a
StatePool, written in place by the kernels, and answers the LayerMemory verbs for it: admission
(a prefix hit copies a checkpoint into a fresh live slot, copy-on-hit; a host-tier hit is promoted
into one), fork, release (a finished request may donate its live state as a checkpoint, no copy),
swap and export/import of a live state. A draft of k tokens holds k + 1 free slots for a step;
accepting j makes slot j - 1 the live one (`accept_draft`). The checkpoints themselves (immutable
copies for prefix hits, their eviction, the host tier they are demoted to, pinned turns' states,
the disk tier's adopted states) are one object the kind owns, `store` (memory/state_checkpoints.py).
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Hashable, Mapping, Optional, Sequence

import torch

from hybridkv.errors import SnapshotMismatchError
from hybridkv.eviction import check_rule
from hybridkv.specs import RecurrentSpec
from hybridkv.state_pool import CHECKPOINT, DRAFT, LIVE, StatePool

from .layer_memory import LayerMemory
from .state_checkpoints import StateCheckpoints


class RecurrentMemory(LayerMemory):
    """conv[layer]: [num_slots, *conv_shape]; ssm[layer]: [num_slots, *state_shape]; slot 0 is null.

    The checkpoints' arguments (memory/state_checkpoints.py):
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
        self._slot: dict[Hashable, int] = {}
        self._draft: dict[Hashable, list[int]] = {}  # rid -> its draft slots while it verifies a draft
        self.store = StateCheckpoints(self.states, eviction, saved_flops or (lambda p: float(p)), reachable,
                                      flop_weight, branches, draft_reserve,
                                      lambda: sum(map(len, self._draft.values())), host_cache_bytes)
        # the store's own objects, read by many callers (the same dict, tier and pins)
        self.checkpoints, self.host, self.pins = self.store.checkpoints, self.store.host, self.store.pins

    @property
    def num_slots(self) -> int:
        return self.states.num_slots

    def live_slot(self, rid: Hashable) -> int:
        return self._slot.get(rid, 0)

    def live_slots(self, rids: Sequence[Hashable]) -> list[int]:
        return list(map(self._slot.get, rids, itertools.repeat(0)))

    def checkpoint(self, rid: Hashable, h: bytes, position: int, output: bool, source: Optional[int] = None) -> bool:
        return self.store.checkpoint(rid, h, position, output, self._slot[rid] if source is None else source)

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
        return self.store.can_take_slot()

    def admit(self, rid: Hashable, hashes: Sequence[bytes], hit: int) -> None:
        if not hit:
            self._slot[rid] = self.store.take_slot(LIVE)
            return
        key = hashes[hit - 1]
        if key not in self.checkpoints:  # a host-tier hit (the match checked it): promote it
            conv, ssm = self.host.promote(key, self.store.tick())
            self._slot[rid] = slot = self.store.take_slot(LIVE)
            t0 = time.perf_counter()
            self.states.from_host(slot, conv, ssm, self._charge_host)
            self.host.counters.promotion_seconds += time.perf_counter() - t0
            return
        src = self.store.hit(key)
        slot = self.store.take_slot(LIVE, protect=key)
        if slot is None:  # the hit's checkpoint is the only slot left: it becomes the live slot
            self._slot[rid] = self.store.hand_over(key)
            self.states.mark(src.slot, LIVE)
            return
        self.store.touch(key)
        self.states.copy(src.slot, slot)
        self._slot[rid] = slot

    def _charge_host(self, seconds: float) -> None:  # a promotion's writes, run layer by layer
        self.host.counters.promotion_seconds += seconds

    # ---- a request's life ------------------------------------------------------------------
    def can_fork(self) -> bool:
        return self.store.can_take_slot()

    def fork(self, parent: Hashable, child: Hashable, num_computed: int) -> None:
        slot = self.store.take_slot(LIVE)
        self.states.copy(self._slot[parent], slot)
        self._slot[child] = slot

    def release(self, rid: Hashable, donate: Optional[tuple[bytes, int]] = None) -> None:
        self._drop_draft(rid)
        slot = self._slot.pop(rid, 0)
        if slot and donate is not None and donate[0] not in self.checkpoints:  # the live state becomes it, no copy
            self.states.mark(slot, CHECKPOINT)
            self.store.add(donate[0], donate[1], slot)
            return
        if slot:
            self.states.free(slot)
        if donate is not None and not self.store.holds(donate[0]):
            self.pins.never_kept(donate[0])  # no live state to keep (swapped out): a pin on it holds nothing

    def forget(self, rid: Hashable) -> None:
        self.store.forget(rid)

    def swap_bytes(self, rid: Hashable, num_computed: int) -> int:
        return self.store.slot_bytes

    def swap_out(self, rid: Hashable, num_computed: int) -> dict:
        slot = self._slot[rid]
        pin = any(t.is_cuda for t in self.states._tensors())
        conv, ssm = self.states.to_host(slot, "cpu", pin)
        self.release(rid)
        return {"conv": conv, "ssm": ssm}

    def can_swap_in(self, copy: dict, end: int) -> bool:
        return self.store.can_take_slot()

    def swap_in(self, rid: Hashable, copy: dict, hashes: Sequence[bytes], num_computed: int) -> None:
        self._slot[rid] = slot = self.store.take_slot(LIVE)
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
        return self.store.can_take_slot()

    def import_(self, rid: Hashable, part: dict, hashes: Sequence[bytes], num_computed: int) -> None:
        self.swap_in(rid, part, hashes, num_computed)

    def layer_shapes(self) -> dict[int, tuple]:
        return {i: ("rec", tuple(s.conv_shape), tuple(s.state_shape), str(s.dtype), str(s.ssm_dtype))
                + (("cache", s.cache_dtype) if s.cache_dtype else ()) for i, s in self.layers.items()}

    def stats(self) -> dict:
        st = self.states
        n = st.count(CHECKPOINT)
        tiers = {"device": {"entries": n, "bytes": n * self.store.slot_bytes, **self.store.device_counts}}
        if self.host is not None:
            tiers["host"] = self.host.stats()
        return {"slots_live": st.count(LIVE), "slots_checkpoint": n,
                "slots_free": st.num_free, "slots_total": max(0, st.num_slots - 1), "tiers": tiers}
