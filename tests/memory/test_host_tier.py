"""The host tier of state checkpoints (hybridkv/memory/host_tier.py) behind RecurrentMemory:
demotion of evicted checkpoints, promotion on a hit with the state's bytes intact, the check
that refuses a corrupted entry, the host budget and its eviction, and a key never in two tiers."""
import time

import pytest
import torch

from hybridkv.memory.host_tier import HostStateTier
from hybridkv.memory.recurrent import RecurrentMemory
from hybridkv.specs import RecurrentSpec

BS = 4
SPECS = {0: RecurrentSpec((2, 3), (2, 2), torch.float32), 1: RecurrentSpec((2, 1), (), torch.float32)}
SLOT_BYTES = (6 + 4 + 2) * 4
H = [b"h1", b"h2", b"h3", b"h4"]  # H[i] keys the checkpoint at position (i + 1) * BS


def memory(checkpoint_slots=1, host_entries=4, rule="lru", live=1):
    return RecurrentMemory(SPECS, BS, 1 + live + checkpoint_slots, eviction=rule,
                           host_cache_bytes=host_entries * SLOT_BYTES)


def fill(mem, rid, value):
    for t in mem.states._tensors():
        t[mem.live_slot(rid)] = value


def live_value(mem, rid):
    mem.states.loads.settle()  # (a promotion's writes wait for each layer's turn: hybridkv/layer_loads.py)
    vals = {float(v) for t in mem.states._tensors() for v in t[mem.live_slot(rid)].reshape(-1)}
    assert len(vals) == 1, vals
    return vals.pop()


def keep(mem, rid, i, value):
    """A request that computed (i + 1) blocks with state `value`, checkpointed there, finished."""
    mem.admit(rid, [], 0)
    fill(mem, rid, value)
    assert mem.checkpoint(rid, H[i], (i + 1) * BS, False)
    mem.release(rid)


def check_conservation(mem):
    assert not set(mem.checkpoints) & set(mem.host.entries), "a key in two tiers"
    assert mem.host.used_bytes == sum(e.nbytes for e in mem.host.entries.values())
    assert mem.host.swap_bytes == sum(mem.host.swapped.values())
    assert mem.host.used_bytes + mem.host.swap_bytes <= mem.host.budget_bytes


def test_eviction_demotes_and_a_hit_promotes_the_same_bytes():
    mem = memory()
    keep(mem, "a", 0, 1.5)
    keep(mem, "b", 1, 2.5)  # one device checkpoint slot: H[0] goes to the host
    assert list(mem.checkpoints) == [H[1]] and list(mem.host.entries) == [H[0]]
    check_conservation(mem)
    assert mem.usable_prefix(H, 1) == 1 and mem.usable_prefix([H[0], b"x"], 2) == 1
    mem.admit("c", H, 1)
    assert live_value(mem, "c") == 1.5
    tiers = mem.stats()["tiers"]
    assert tiers["host"]["promotion_seconds"] > 0  # the copy's wall time
    assert tiers["host"] | {"budget_bytes": 0, "promotion_seconds": 0} == {
        "entries": 1, "bytes": SLOT_BYTES, "budget_bytes": 0, "hits": 1, "promotions": 1, "demotions": 1,
        "refused_demotions": 0, "evictions": 0, "refused_corrupt": 0, "promotion_seconds": 0,
        "swap_bytes": 0, "swaps_refused": 0, "pinned_entries": 0, "pinned_demotions": 0, "refused_pinned": 0}
    assert tiers["device"] == {"entries": 1, "bytes": SLOT_BYTES, "hits": 0, "evictions": 1}
    mem.admit("d", H, 2)  # a device hit still copies from the device
    assert live_value(mem, "d") == 2.5 and mem.stats()["tiers"]["device"]["hits"] == 1


@pytest.mark.parametrize("corrupt", ["bit", "dtype", "shape", "position"])
def test_a_corrupted_entry_is_refused_and_dropped(corrupt):
    mem = memory()
    keep(mem, "a", 0, 1.5)
    keep(mem, "b", 1, 2.5)
    e = mem.host.entries[H[0]]
    if corrupt == "bit":
        e.ssm[0].view(-1).view(torch.int32)[0] ^= 1
    elif corrupt == "dtype":
        e.conv[0] = e.conv[0].to(torch.float64)
    elif corrupt == "shape":
        e.conv[1] = e.conv[1].reshape(1, 2)
    else:
        e.position = 2 * BS
    assert mem.usable_prefix(H, 1) == 0
    assert H[0] not in mem.host and mem.stats()["tiers"]["host"]["refused_corrupt"] == 1
    check_conservation(mem)


def test_host_budget_evicts_by_the_rule():
    mem = memory(host_entries=2)
    for i, rid in enumerate("abcd"):
        keep(mem, rid, i, float(i + 1))
        check_conservation(mem)
    # H[0], H[1], H[2] were demoted in turn; two fit, so LRU evicted H[0]
    assert list(mem.checkpoints) == [H[3]] and list(mem.host.entries) == [H[1], H[2]]
    assert mem.stats()["tiers"]["host"]["evictions"] == 1
    mem.admit("e", H, 3)
    assert live_value(mem, "e") == 3.0


def test_not_worth_its_bytes_is_dropped():
    tier = HostStateTier(SLOT_BYTES, "flop", saved_flops=float, branches=lambda h: 0, reachable=lambda h: True)
    conv = {0: torch.ones(2, 3), 1: torch.ones(2, 1)}
    ssm = {0: torch.ones(2, 2)}
    assert tier.put(b"deep", 16, last_used=5, conv=conv, ssm=ssm)
    # older and shallower than what the host holds: the rule would evict it first
    assert not tier.worth(b"shallow", 4, 1, SLOT_BYTES)
    assert not tier.put(b"shallow", 4, last_used=1, conv=conv, ssm=ssm)
    assert list(tier.entries) == [b"deep"] and tier.counters.refused_demotions == 1
    assert tier.put(b"deeper", 32, last_used=6, conv=conv, ssm=ssm)  # better: the old one goes
    assert list(tier.entries) == [b"deeper"] and tier.counters.evictions == 1


def test_unreachable_entries_go_first():
    gone = set()
    tier = HostStateTier(2 * SLOT_BYTES, "lru", float, lambda h: 0, lambda h: h not in gone)
    conv, ssm = {0: torch.ones(2, 3), 1: torch.ones(2, 1)}, {0: torch.ones(2, 2)}
    tier.put(b"a", 4, 1, conv, ssm)
    tier.put(b"b", 8, 2, conv, ssm)
    gone.add(b"b")  # its KV left the cache: the newer entry is useless
    assert tier.put(b"c", 12, 3, conv, ssm)
    assert list(tier.entries) == [b"a", b"c"]


def test_a_device_checkpoint_supersedes_the_host_copy():
    mem = memory()
    keep(mem, "a", 0, 1.5)
    keep(mem, "b", 1, 2.5)
    assert H[0] in mem.host
    keep(mem, "c", 0, 1.5)  # the same prefix checkpointed again on the device
    assert H[0] in mem.checkpoints and H[0] not in mem.host and H[1] in mem.host
    check_conservation(mem)


def test_demotion_inside_deferred_copies_reads_the_pending_state():
    # a step's checkpoints copy at the exit; one evicted before then must be demoted with its
    # state (the live slot it is a copy of), not the stale bytes of its slot
    mem = memory(live=2)
    mem.admit("a", [], 0)
    mem.admit("b", [], 0)
    fill(mem, "a", 1.5)
    fill(mem, "b", 2.5)
    with mem.states.deferred_copies():
        assert mem.checkpoint("a", H[0], BS, False)
        assert mem.checkpoint("b", H[1], 2 * BS, False)  # evicts H[0] while its copy is pending
    assert H[0] in mem.host
    mem.release("a")
    mem.admit("c", H, 1)
    assert live_value(mem, "c") == 1.5


def test_the_hit_checkpoint_as_the_last_slot_keeps_a_host_copy():
    mem = RecurrentMemory(SPECS, BS, 3, eviction="lru", host_cache_bytes=4 * SLOT_BYTES)  # null, live, one more
    keep(mem, "a", 0, 1.5)
    mem.admit("b", [], 0)  # takes the last free slot
    mem.admit("c", H, 1)  # no slot but the checkpoint's: it becomes c's live slot, a copy stays on the host
    assert live_value(mem, "c") == 1.5 and H[0] not in mem.checkpoints and H[0] in mem.host
    check_conservation(mem)


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match="host_cache_bytes=-1"):
        RecurrentMemory(SPECS, BS, 3, host_cache_bytes=-1)


@pytest.mark.parametrize("host_entries", [0, 4])
def test_an_output_state_displaces_a_prompt_state_only_into_the_host(host_entries):
    mem = memory(host_entries=host_entries) if host_entries else RecurrentMemory(SPECS, BS, 3, eviction="lru")
    keep(mem, "a", 0, 1.5)  # a prompt state in the one checkpoint slot
    mem.admit("b", [], 0)
    fill(mem, "b", 2.5)
    kept = mem.checkpoint("b", H[1], 2 * BS, True)  # an output (rolling) state
    if host_entries:
        assert kept and list(mem.checkpoints) == [H[1]] and list(mem.host.entries) == [H[0]]
    else:  # without a host it may displace only output states: refused, the prompt state stays
        assert not kept and list(mem.checkpoints) == [H[0]]


def test_a_swap_holds_host_bytes_and_evicts_entries_for_them():
    """Swap uses the host budget: entries are evicted by the rule to make room for a swapped
    request, never the other way; a swap that cannot fit changes nothing and is counted."""
    mem = memory(host_entries=3)
    for i, rid in enumerate("abcd"):  # H[0..2] demoted: the host is full of entries
        keep(mem, rid, i, float(i + 1))
    assert list(mem.host.entries) == [H[0], H[1], H[2]]
    host = mem.host
    assert host.hold("s1", 2 * SLOT_BYTES)  # two entries go, least recently used first (lru)
    assert list(host.entries) == [H[2]] and host.swap_bytes == 2 * SLOT_BYTES
    check_conservation(mem)
    assert not host.hold("s2", 2 * SLOT_BYTES)  # 1 slot's bytes left even with no entry: refused
    assert list(host.entries) == [H[2]] and host.swapped == {"s1": 2 * SLOT_BYTES}
    assert host.stats()["swaps_refused"] == 1 and host.stats()["evictions"] == 2
    mem.admit("e", [], 0)  # a new checkpoint pushes H[3] out of the device: the host has room
    fill(mem, "e", 9.0)   # beside the swap only by evicting H[2]
    assert mem.checkpoint("e", b"h5", 5 * BS, False)
    mem.release("e")
    check_conservation(mem)
    assert list(host.entries) == [H[3]] and host.swapped == {"s1": 2 * SLOT_BYTES}  # the swap's bytes stayed
    with pytest.raises(RuntimeError, match="swapped out twice"):
        host.hold("s1", 1)
    host.let_go("s1")
    host.let_go("never-held")  # nothing held: nothing changes
    assert host.swap_bytes == 0 and host.swapped == {}
    assert host.hold("s2", 3 * SLOT_BYTES - 1) and list(host.entries) == []


def test_a_pinned_entry_stays_until_a_swap_needs_its_bytes():
    """A demotion never evicts a pinned turn's host entry (the newcomer is dropped instead); a
    swapped request's bytes (a running request's memory) take it last, counted as reclaimed."""
    mem = memory(host_entries=1)
    keep(mem, "a", 0, 1.0)
    keep(mem, "b", 1, 2.0)  # one device checkpoint slot: H[0] is demoted to the host
    assert list(mem.host.entries) == [H[0]]
    mem.pins.pin(H[0], 1e12)
    keep(mem, "c", 2, 3.0)  # H[1] leaves the device; the host's one place is pinned: H[1] is dropped
    assert list(mem.host.entries) == [H[0]] and list(mem.checkpoints) == [H[2]]
    assert H[1] not in mem.host and mem.pins.reclaimed == 0
    assert mem.host.hold("swapped", SLOT_BYTES)  # only a pin is left to give way: it does, counted
    assert len(mem.host) == 0 and mem.pins.reclaimed == 1 and H[0] not in mem.pins.until


def _tier(entries, rule, branches=lambda h: 0):
    return HostStateTier(entries * SLOT_BYTES, rule, saved_flops=float, branches=branches, reachable=lambda h: True)


def _state():
    return {0: torch.ones(2, 3), 1: torch.ones(2, 1)}, {0: torch.ones(2, 2)}


def test_an_output_state_is_worth_the_tokens_since_the_state_kept_before_it():
    tier = _tier(2, "flop")
    tier.block_size = BS
    parents = {b"o40": b"p36", b"p36": b"e32", b"e32": b"p28", b"lone": b"x"}
    tier.parent_of = parents.get
    tier.put(b"e32", 32, 1, *_state())  # a prompt's end
    tier.put(b"o40", 40, 2, *_state(), output=True)  # its answer's state, 8 tokens past it
    assert tier.entries[b"o40"].worth == 8 and tier.entries[b"e32"].worth == 32
    # a newer inner state: the answer's state goes, not the prompt's end (by position it would be
    # e32: flop scores e32 0 + 32/40, o40 1/2 + 1, new 1 + 16/40)
    assert tier.put(b"t16", 16, 3, *_state())
    assert set(tier.entries) == {b"e32", b"t16"}
    # with nothing kept before it on its path, an output state is worth its position
    assert tier._worth(b"lone", 44, output=True) == 44
    # a device checkpoint counts as kept
    tier.on_device = {b"x"}.__contains__
    assert tier._worth(b"lone", 44, output=True) == 4


def test_a_state_some_request_ran_past_is_not_penalised_in_the_host():
    """The device's 'utility' rule takes 1 off a passed state (eviction.PASSED_PENALTY); the host
    keeps it as a fallback for a request branching below it, so ranks it by recency and FLOPs."""
    tier = _tier(2, "utility", branches=lambda h: 1 if h == b"inner" else 0)
    tier.put(b"inner", 32, 1, *_state())
    tier.put(b"leaf", 8, 2, *_state())
    # scores: inner 0/2 + 32/32 (- 1 on the device), leaf 1/2 + 8/32, the newcomer 1 + 8/32
    assert tier.put(b"new", 8, 3, *_state())
    assert set(tier.entries) == {b"inner", b"new"}


def test_the_manager_gives_the_host_the_prefix_tree_and_the_device_keys():
    """make_kinds wires the host's parent_of (the attention pool's parent hashes) and on_device."""
    from hybridkv.memory.kinds import make_kinds
    from hybridkv.specs import AttentionSpec

    kinds = make_kinds({0: AttentionSpec(1, 4, torch.float32), **{i + 1: s for i, s in SPECS.items()}}, BS, 8,
                       4, "cpu", "utility", None, None, host_cache_bytes=4 * SLOT_BYTES)
    host, pool = kinds.recurrent.host, kinds.attention.pool
    assert host.block_size == BS
    pool.set_hash(1, b"first")
    pool.set_hash(2, b"second", parent=b"first")
    assert host.parent_of(b"second") == b"first" and host.parent_of(b"first") is None
    assert host.parent_of(b"unknown") is None
    kinds.recurrent.admit("r", [], 0)
    assert kinds.recurrent.checkpoint("r", b"second", 2 * BS, False)
    assert host.on_device(b"second") and not host.on_device(b"first")


def test_a_pinned_checkpoint_that_becomes_the_last_live_slot_is_demoted_with_its_pin():
    """A hit takes the only slot, a pinned turn's state, as its live slot: the state is demoted to
    the host first, still pinned, so the pin is not lost (the state stays findable there)."""
    mem = memory(checkpoint_slots=0)  # one slot
    mem.admit("a", [], 0)
    fill(mem, "a", 1.5)
    mem.pins.pin(H[0], 1e12)  # a pinned turn that ends after one block: its live state stays as H[0]
    mem.release("a", (H[0], BS))
    mem.admit("b", H, 1)
    assert not mem.checkpoints and list(mem.host.entries) == [H[0]] and live_value(mem, "b") == 1.5
    assert mem.pins.until == {H[0]: 1e12} and mem.pins.reclaimed == 0
    assert mem.stats()["tiers"]["host"]["pinned_entries"] == 1
    assert mem.usable_prefix(H, 1) == 1
    check_conservation(mem)


@pytest.mark.parametrize("pinned", [False, True])
def test_a_requests_next_output_state_lets_its_older_one_go_from_the_host_too(pinned):
    """One rolling output state per request, in every tier: the old one a request ran past leaves
    the host when the next is kept (it was demoted there), unless a pinned turn holds it."""
    mem = memory(live=2)
    mem.admit("b", [], 0)
    fill(mem, "b", 2.5)
    assert mem.checkpoint("b", H[1], 2 * BS, True)
    keep(mem, "a", 0, 1.5)  # a prompt state takes the one device slot: b's output state is demoted
    assert list(mem.checkpoints) == [H[0]] and list(mem.host.entries) == [H[1]]
    if pinned:
        mem.pins.pin(H[1], time.monotonic() + 600)
    assert mem.checkpoint("b", H[2], 3 * BS, True)  # b's next output state
    assert list(mem.checkpoints) == [H[0], H[2]]  # (a's live slot is free again)
    assert list(mem.host.entries) == ([H[1]] if pinned else [])
    check_conservation(mem)


def test_the_host_weighs_saved_flops_more_against_recency_than_the_device():
    """flop scores (recency rank + w x FLOPs / max): deep 0 + w, mid 1/2 + 0.6 w, a newcomer at
    10 tokens 1 + 0.1 w. The device's w = 1 would evict the deep state (1.0 < 1.1); the host's
    w = 1.5 keeps it and refuses the newcomer (1.15 < 1.4 < 1.5)."""
    from hybridkv.eviction import choose_victim
    from hybridkv.memory.host_tier import HOST_FLOP_SCALE

    assert choose_victim("flop", [100, 60, 10], float, 1.0) == 0
    assert choose_victim("flop", [100, 60, 10], float, HOST_FLOP_SCALE) == 2
    tier = _tier(2, "flop")
    tier.put(b"deep", 100, 1, *_state())
    tier.put(b"mid", 60, 2, *_state())
    assert not tier.put(b"new", 10, 3, *_state())
    assert set(tier.entries) == {b"deep", b"mid"} and tier.counters.refused_demotions == 1


def _live(mem, *rids):
    for rid in rids:
        mem.admit(rid, [], 0)


def test_a_pinned_state_evicted_for_a_live_slot_reaches_the_host_pinned():
    """A running request needs the slot of a pinned turn's state: the state is demoted to the host
    WITH its pin (not a lost pin: it stays findable), and a later hit promotes it from there."""
    mem = memory(checkpoint_slots=1, live=1)
    keep(mem, "a", 0, 1.5)
    mem.pins.pin(H[0], 1e12)
    _live(mem, "x", "y")  # two live slots, one checkpoint slot: H[0] leaves the device for "y"
    assert not mem.checkpoints and list(mem.host.entries) == [H[0]]
    assert mem.pins.until == {H[0]: 1e12} and mem.pins.reclaimed == 0
    host = mem.stats()["tiers"]["host"]
    assert host["pinned_demotions"] == 1 and host["pinned_entries"] == 1
    mem.release("x")
    mem.release("y")
    assert mem.usable_prefix(H, 2) == 1
    mem.admit("z", H, 1)
    assert live_value(mem, "z") == 1.5 and H[0] in mem.pins.until
    check_conservation(mem)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_newcomer_evicts_unpinned_host_entries_the_rule_would_keep(pinned):
    """The host's rule would refuse a state worth less than its entry (flop: an old, shallow state
    against a deep, just-used one); pinned, the newcomer takes the unpinned entry's place instead."""
    mem = memory(checkpoint_slots=1, host_entries=1, rule="flop")
    keep(mem, "a", 3, 4.0)
    keep(mem, "b", 0, 1.0)  # H[3] goes to the host, H[0] holds the device's checkpoint slot
    mem.admit("c", H[:3] + [H[3]], 4)  # a host hit: H[3] is the most recently used now
    mem.release("c")
    if pinned:
        mem.pins.pin(H[0], 1e12)
    _live(mem, "x", "y")  # H[0] leaves the device for a live slot
    assert list(mem.host.entries) == ([H[0]] if pinned else [H[3]])
    assert mem.pins.reclaimed == 0 and list(mem.pins.until) == ([H[0]] if pinned else [])
    check_conservation(mem)


def test_a_pinned_newcomer_that_does_not_fit_beside_the_hosts_pins_is_dropped_and_counted():
    """Only pins in the host and no room for another: the newcomer (a pinned state the device gives
    up for a live slot) is dropped; its pin is lost, counted, and leaves the pin map."""
    mem = memory(checkpoint_slots=1, host_entries=1)
    keep(mem, "a", 3, 4.0)
    mem.pins.pin(H[3], 1e12)
    _live(mem, "x", "y")  # H[3] to the host, pinned
    mem.release("x")
    mem.release("y")
    keep(mem, "b", 0, 1.0)
    mem.pins.pin(H[0], 1e12)
    _live(mem, "x", "y")  # H[0] leaves the device; the host holds only a pin: H[0] is not kept
    assert list(mem.host.entries) == [H[3]] and not mem.checkpoints
    assert mem.pins.until == {H[3]: 1e12} and mem.pins.reclaimed == 1
    host = mem.stats()["tiers"]["host"]
    assert host["refused_pinned"] == 1 and host["pinned_entries"] == 1
    check_conservation(mem)
