"""RecurrentMemory on its own: live slots, checkpoints (copy-on-hit, dedup), eviction order."""
import contextlib
import random

import pytest
import torch

from hybridkv.memory.recurrent import RecurrentMemory
from hybridkv.specs import RecurrentSpec
from hybridkv.state_pool import CHECKPOINT

SPEC = {1: RecurrentSpec((2, 3), (2, 2), torch.float32)}


def make(n_slots=4, eviction="lru", saved=None, reachable=lambda h: True):
    return RecurrentMemory(SPEC, 4, n_slots, eviction=eviction, saved_flops=saved, reachable=reachable)


def checkpoint(mem, h, pos, value=0.0):
    slot = mem.states.allocate(CHECKPOINT)
    mem.states.conv[1][slot] = value
    mem.store.add(h, pos, slot)
    return slot


def test_hit_copies_the_checkpoint_into_a_fresh_live_slot():
    mem = make()
    slot = checkpoint(mem, b"h1", 4, value=5.0)
    assert mem.usable_prefix([b"h0", b"h1", b"h2"], 3) == 2 and mem.usable_prefix([b"h0"], 1) == 0
    mem.admit("a", [b"h0", b"h1"], 2)
    live = mem.live_slot("a")
    assert live not in (0, slot) and bool((mem.states.conv[1][live] == 5.0).all())
    mem.states.conv[1][live] = 7.0  # the live slot is written in place; the checkpoint never changes
    assert bool((mem.states.conv[1][slot] == 5.0).all())


def test_last_slot_hit_turns_the_checkpoint_into_the_live_slot():
    mem = make(n_slots=2)  # one usable slot, held by the checkpoint
    slot = checkpoint(mem, b"h0", 4)
    assert mem.can_admit([b"h0"], 1, 8)
    mem.admit("a", [b"h0"], 1)
    assert mem.live_slot("a") == slot and not mem.checkpoints


def test_a_pinned_checkpoint_that_becomes_the_last_live_slot_is_counted_as_reclaimed():
    """A hit on a pinned turn's state when no other slot can be freed: the state becomes the live
    slot (a running request's memory takes the pin, as the rule allows), so its pin is reclaimed and
    counted; a pin past its deadline goes uncounted."""
    for deadline, counted in [(1e12, 1), (0.0, 0)]:
        mem = make(n_slots=2)  # one usable slot, held by the checkpoint
        slot = checkpoint(mem, b"h0", 4)
        mem.pins.pin(b"h0", deadline)
        mem.admit("a", [b"h0"], 1)
        assert mem.live_slot("a") == slot and not mem.checkpoints
        assert mem.pins.reclaimed == counted and b"h0" not in mem.pins.until


def test_a_rolling_output_state_a_pinned_turn_pinned_is_not_replaced_by_the_next():
    """Each request keeps one rolling output state, the next replacing the old in its slot. When a
    pinned turn pinned the old one (a twin with the same tokens ended pinned), it stays: the new one
    takes a slot as any checkpoint does (none here: it is not kept) and never displaces the pin.
    A pin past its deadline is no pin: the old state is replaced as usual."""
    for deadline, kept in [(1e12, [b"o1"]), (0.0, [b"o2"])]:
        mem = make(n_slots=3)  # the live slot and one more
        mem.admit("a", [], 0)
        assert mem.checkpoint("a", b"o1", 8, True)
        mem.pins.pin(b"o1", deadline)
        assert mem.checkpoint("a", b"o2", 12, True) == (kept == [b"o2"])
        assert list(mem.checkpoints) == kept and mem.pins.reclaimed == 0


def test_take_slot_reclaims_unreachable_first_then_lru():
    gone = {b"c"}
    mem = make(n_slots=4, reachable=lambda h: h not in gone)  # 3 usable slots
    _, b, c = checkpoint(mem, b"a", 4), checkpoint(mem, b"b", 8), checkpoint(mem, b"c", 12)
    mem.store.touch(b"a")  # LRU order now b, c, a
    assert mem.store.take_slot("live") == c and set(mem.checkpoints) == {b"a", b"b"}
    assert mem.store.take_slot("live") == b  # LRU
    assert mem.store.take_slot("live", protect=b"a") is None and b"a" in mem.checkpoints


def test_flop_aware_eviction_prefers_short_prefixes():
    mem = make(n_slots=4, eviction="flop", saved=lambda p: float(p * p))
    long_old = checkpoint(mem, b"long", 32)
    short_mid = checkpoint(mem, b"short", 4)
    checkpoint(mem, b"mid", 8)
    # LRU would drop the oldest (32 tokens); FLOP-aware keeps it: it saves 64x the prefill of 4 tokens
    assert mem.store.take_slot("live") == short_mid and b"long" in mem.checkpoints
    assert long_old in [c.slot for c in mem.checkpoints.values()]


def test_checkpoint_copies_and_dedups_and_output_states_roll():
    mem = make(n_slots=5)
    mem.admit("a", [], 0)
    mem.states.conv[1][mem.live_slot("a")] = 3.0
    assert mem.checkpoint("a", b"p", 4, output=False) and not mem.checkpoint("a", b"p", 4, output=False)
    assert bool((mem.states.conv[1][mem.checkpoints[b"p"].slot] == 3.0).all())
    assert mem.checkpoint("a", b"o1", 8, output=True) and mem.checkpoint("a", b"o2", 12, output=True)
    assert set(mem.checkpoints) == {b"p", b"o2"}  # one rolling output state per request
    mem.release("a", donate=(b"end", 16))  # the live state stays as a checkpoint, no copy
    assert b"end" in mem.checkpoints and mem.stats()["slots_live"] == 0


def _drop_then_checkpoint(mem, rid, h, pos, output):
    """checkpoint() as it was before the rolling state reused its slot in place: the old
    rolling state freed first, then a slot taken (the free list, eviction) for the new one."""
    old = mem.store.rolling.get(rid) if output else None
    if old is not None and old != h and old in mem.checkpoints and h not in mem.checkpoints:
        mem.store.drop(old)
    return mem.checkpoint(rid, h, pos, output)


def _observed(mem):
    return ([(h, c.slot, c.position, c.last_used, c.output) for h, c in mem.checkpoints.items()],
            list(mem.states.kind), list(mem.states._free), mem.store.clock, dict(mem._slot), dict(mem.store.rolling),
            [t.clone() for t in mem.states._tensors()])


@pytest.mark.parametrize("eviction", ["lru", "flop"])
def test_rolling_output_state_in_place_equals_free_then_take(eviction):
    """The rolling output checkpoint that takes its predecessor's slot in place leaves exactly what
    freeing it and taking a slot did: same keys, slots, positions, clock and LRU order, free list,
    slot kinds and state contents, over random admits (hits), checkpoints (prompt and output,
    deferred copies or not), finishes and evictions on a tight pool."""
    rng = random.Random(eviction)
    mems = [make(n_slots=7, eviction=eviction), make(n_slots=7, eviction=eviction)]
    keys = [bytes([i]) for i in range(24)]
    running: list[str] = []
    for step in range(600):
        op, rid = rng.random(), f"r{rng.randrange(6)}"
        if op < 0.15 and rid not in running:
            cached = [i for i, h in enumerate(keys) if h in mems[0].checkpoints]
            hit = rng.choice([0] + [i + 1 for i in cached])
            if not all(m.can_admit(keys[:hit], hit, 0) for m in mems):
                continue
            for m in mems:
                m.admit(rid, keys[:hit], hit)
            running.append(rid)
        elif op < 0.25 and rid in running:
            donate = rng.choice([None, (keys[rng.randrange(24)], 64)])
            for m in mems:
                m.release(rid, donate)
                m.forget(rid)
            running.remove(rid)
        elif running:
            rid = rng.choice(running)
            value = torch.randn(mems[0].states.conv[1][0].shape)
            for m in mems:
                m.states.conv[1][m.live_slot(rid)] = value
            h, pos, output = keys[rng.randrange(24)], 4 * rng.randrange(1, 16), rng.random() < 0.8
            deferred = rng.random() < 0.5
            done = []
            for m, call in zip(mems, (RecurrentMemory.checkpoint, _drop_then_checkpoint)):
                with m.states.deferred_copies() if deferred else contextlib.nullcontext():
                    done.append(call(m, rid, h, pos, output))
            assert done[0] == done[1]
        a, b = _observed(mems[0]), _observed(mems[1])
        assert a[:-1] == b[:-1] and all(torch.equal(x, y) for x, y in zip(a[-1], b[-1])), step


def test_a_pinned_state_yields_to_a_live_slot_not_to_another_checkpoint():
    """Pinned turns (prefix_cache.pin): a pinned checkpoint is never displaced by another one,
    but gives way when a running request needs its slot (counted); a past deadline unpins it."""
    mem = make(n_slots=3)  # null + 2
    checkpoint(mem, b"pinned", 4)
    mem.pins.pin(b"pinned", until=float("inf"))
    mem.admit("a", [], 0)  # the last free slot
    assert not mem.checkpoint("a", b"other", 8, False)  # no unpinned victim: the new state is not kept
    assert b"pinned" in mem.checkpoints and mem.pins.reclaimed == 0
    mem.admit("b", [], 0)  # a running request needs a slot: the pin gives way
    assert b"pinned" not in mem.checkpoints and mem.pins.reclaimed == 1 and not mem.pins.until
    mem.release("a")
    checkpoint(mem, b"late", 4)
    mem.pins.pin(b"late", until=0.0)  # (monotonic time is past it)
    mem.admit("c", [], 0)  # evicts "late" as any checkpoint: an expired pin is no pin
    assert b"late" not in mem.checkpoints and mem.live_slot("c") and mem.pins.reclaimed == 1


def test_a_pinned_state_that_leaves_takes_its_pin_along():
    """A pin belongs to a state some tier holds: a pinned checkpoint dropped as unreachable (its KV
    went) loses its pin (counted: it left every tier before its deadline), so a later checkpoint
    under the same key is not pinned; an invalidated one too; and a pinned turn's final state that
    no release kept (no live slot) leaves no pin behind (uncounted: it was never held)."""
    gone = set()
    mem = make(n_slots=3, reachable=lambda h: h not in gone)  # null + 2
    checkpoint(mem, b"p", 4)
    mem.pins.pin(b"p", 1e12)
    gone.add(b"p")
    mem.admit("a", [], 0)
    mem.admit("b", [], 0)  # a slot is needed: the unreachable pinned state is dropped
    assert b"p" not in mem.checkpoints and not mem.pins.until and mem.pins.reclaimed == 1
    mem.release("b")
    gone.clear()
    checkpoint(mem, b"p", 4)  # the prefix recomputed: a new state under the same key, unpinned
    assert mem.checkpoint("a", b"q", 8, False)  # so another checkpoint may displace it
    assert list(mem.checkpoints) == [b"q"] and mem.pins.reclaimed == 1
    mem.pins.pin(b"q", 1e12)
    assert mem.store.invalidate(b"q") and not mem.pins.until and mem.pins.reclaimed == 2
    mem.pins.pin(b"never", 1e12)
    mem.release("not-running", (b"never", 4))
    assert not mem.pins.until and mem.pins.reclaimed == 2
