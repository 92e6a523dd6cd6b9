"""The manager's state machine (test_state_machine.py) with pinned turns (prefix_cache.pin,
SamplingParams.cache_pin_ttl_s) and a clock the test drives.

A rule ends a running request as a pinned turn with a TTL of tens of seconds or of days, and a rule
moves the clock forward; the pins read a fake monotonic clock, so a run never depends on wall time.
After every rule, whatever the verbs did (admissions and hits, chunks, batched decodes, forks,
checkpoints, swaps and recomputes, migrations), the documented rule holds (docs/design.md,
"Memory tiers", "Pinned turns"):
- a pinned KV block keeps the hash it was pinned for, and answers for it when free, until its pin
  is reclaimed (counted in its pool's `pins_reclaimed`) or its deadline passes;
- a pinned KV block the pool must hand out goes to the host KV tier with its pin when that tier
  keeps it (not counted); a pinned host KV entry stays until its deadline, is promoted (or
  superseded) back onto a device block that takes its pin, or is counted (`HostKvTier.pins_reclaimed`);
- a pinned state stays findable WITH its pin, a checkpoint on the device or an entry of the host
  tier (demoted there pinned when the device evicts it), until its deadline passes or it leaves
  every tier, which is counted (`RecurrentMemory.pins.reclaimed`) whatever took it (a running
  request's memory, or a reclaimed block that took the KV it resumes from);
- the pin map holds no key that no tier holds (a state that leaves takes its pin along), and
  `stats().pins` counts only live pins;
- a pin that leaves before its deadline is counted, once, unless a pinned block passes its pin on
  to the block that answers its hash (a pinned twin let go: block_pool.release) or to the host.
"""
import sys
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

import hybridkv.block_pool
import hybridkv.manager_stats
import hybridkv.memory.host_kv_tier
import hybridkv.memory.recurrent
import hybridkv.memory.state_pins
import hybridkv.prefix_cache
from hybridkv.request import RequestStatus
from hybridkv.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))  # the manager's machine, which this one extends
from test_state_machine import EVENTS, ManagerMachine  # noqa: E402


class FakeClock:
    """The monotonic clock the pins read: it moves only when the machine says."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


CLOCK = FakeClock()


@pytest.fixture
def fake_clock(monkeypatch):
    """Every module that reads the pins' clock reads CLOCK (perf_counter, for timings, stays real)."""
    import time
    shim = types.SimpleNamespace(monotonic=CLOCK.monotonic, perf_counter=time.perf_counter)
    for module in (hybridkv.block_pool, hybridkv.memory.recurrent, hybridkv.memory.state_pins,
                   hybridkv.memory.host_kv_tier, hybridkv.prefix_cache, hybridkv.manager_stats):
        monkeypatch.setattr(module, "time", shim)
    return CLOCK


class PinnedTurnsMachine(ManagerMachine):
    """The manager's machine with prefix caching on, a rule that ends a running request as a pinned
    turn, a rule that moves the clock, and the pins' invariant (module docstring)."""

    force_caching = True  # (no pin without prefix caching)

    @precondition(lambda self: self.ids(RequestStatus.RUNNING))
    @rule(data=st.data(), ttl=st.sampled_from([30.0, 1e6, 1e6]))
    def finish_pinned(self, data, ttl):
        """A running request ends as a pinned turn of `ttl` seconds."""
        rid = data.draw(st.sampled_from(self.ids(RequestStatus.RUNNING)))
        mgr = self.mgr
        r = mgr.request(rid)
        hashes = r.block_hashes[:r.num_hashed_blocks]
        # each of its hashes: the block that answers it, r's own when none does (it will when let go), or
        # none (NO_BLOCK: it left the window and no block answers its hash now)
        answering = {w: [(h, g.pool.cached.get(h, b)) for h, b in zip(hashes, g.block_ids(rid))]
                     for w, g in mgr.attention_groups.items()}
        r.params = SamplingParams(max_tokens=max(1, r.max_tokens), cache_pin_ttl_s=ttl)
        turns = mgr.prefix_cache.pinned_turns
        self.pinning = True
        mgr.finish(rid)
        assert mgr.prefix_cache.pinned_turns == turns + 1
        until = CLOCK.now + ttl
        for w, blocks in answering.items():  # pinned, holding that hash
            pool = mgr.attention_groups[w].pool
            for h, b in blocks:
                assert b < 0 or pool.pinned_until.get(b, 0) >= until and pool.block_hash[b] == h, \
                    "a pinned turn's block does not hold its hash"
        rec = mgr.recurrent
        if rec is not None:  # every state it kept along its blocks whose KV the lead group pinned
            lead = [blocks for w, blocks in answering.items() if mgr.attention_groups[w] is mgr.attention]
            kv = {h for h, b in lead[0] if b >= 0} if lead else None
            kept = [h for h in hashes if h in rec.checkpoints and (kv is None or h in kv)]
            assert all(rec.pins.until.get(h, 0) >= until for h in kept), "a pinned turn's state is not pinned"
            EVENTS["pinned turn kept a state"] += bool(kept)
        EVENTS["pinned turn"] += 1

    @rule(seconds=st.sampled_from([1.0, 20.0, 45.0]))
    def advance_clock(self, seconds):
        CLOCK.now += seconds

    @invariant()
    def pins_hold(self):
        if not hasattr(self, "mgr"):
            return
        mgr, now = self.mgr, CLOCK.now
        pinning, self.pinning = getattr(self, "pinning", False), False
        seen = self.__dict__.setdefault("pins_seen", {})
        host_kv = mgr.prefix_cache.host_kv
        host_kv_pins = {k: e.pinned_until for k, e in host_kv.entries.items() if e.pinned_until} if host_kv else {}
        host_kv_before = seen.get("host KV", {})  # {(window, hash): deadline} at the last check
        for w, g in mgr.attention_groups.items():
            pool = g.pool
            before, reclaimed = seen.get(w, ({}, 0))  # {block: (the hash it was pinned for, deadline)}
            gone = [b for b in before if b not in pool.pinned_until and before[b][1] > now]
            # a pin that left before its deadline was reclaimed (counted) unless it passed to the block that
            # answers its hash (a pinned twin let go: block_pool.release) or went to the host KV tier with
            # its block (demoted, pinned: host_kv_tier.py)
            holders = {pool.block_hash[b]: t for b, t in pool.pinned_until.items() if b not in before}
            passed = [b for b in gone if holders.get(before[b][0], 0) >= before[b][1]
                      or any(before[c][0] == before[b][0] and pool.pinned_until.get(c, 0) >= before[b][1] for c in before)]
            demoted = [b for b in gone if b not in passed and host_kv_pins.get((w, before[b][0]), 0) >= before[b][1]]
            taken = [b for b in gone if b not in passed and b not in demoted]
            assert len(taken) <= pool.pins_reclaimed - reclaimed <= len(gone) - len(demoted), \
                f"{len(taken)} pinned blocks let go before their deadline and no tier holds their hash pinned, " \
                f"{pool.pins_reclaimed - reclaimed} reclaims counted ({len(demoted)} demoted to the host pinned)"
            passed_hashes = {before[b][0] for b in passed}
            for b, until in pool.pinned_until.items():
                h = before[b][0] if b in before else pool.block_hash[b]
                assert b in before or pinning or h in passed_hashes or (w, h) in host_kv_before, \
                    f"block {b} was pinned by a verb that ends no pinned turn (nor promoted from the host)"
                if until <= now:
                    continue  # past its deadline: eviction may take it
                assert pool.block_hash[b] == h, f"pinned block {b} lost its hash without being reclaimed"
                assert pool.refcount[b] or pool.cached.get(h) == b, f"free pinned block {b} no longer answers its hash"
                EVENTS["pinned block checked"] += 1
            EVENTS["pinned block reclaimed"] += pool.pins_reclaimed - reclaimed
            EVENTS["pinned block passed its pin on"] += len(passed)
            EVENTS["pinned block demoted to host"] += len(demoted)
            EVENTS["pinned block expired"] += sum(1 for b in before if b not in pool.pinned_until and before[b][1] <= now)
            seen[w] = ({b: (before[b][0] if b in before else pool.block_hash[b], t)
                        for b, t in pool.pinned_until.items()}, pool.pins_reclaimed)
        if host_kv is not None:  # a pinned host KV entry stays until its deadline, back on the device, or counted
            reclaimed = seen.get("host KV reclaimed", 0)
            gone = [k for k, t in host_kv_before.items() if k not in host_kv_pins and t > now]
            back = [k for k in gone if any(mgr.attention_groups[k[0]].pool.block_hash[b] == k[1] and t >= host_kv_before[k]
                                           for b, t in mgr.attention_groups[k[0]].pool.pinned_until.items())]
            assert len(gone) - len(back) <= host_kv.pins_reclaimed - reclaimed <= len(gone), \
                f"{len(gone) - len(back)} pinned host KV entries left before their deadline, " \
                f"{host_kv.pins_reclaimed - reclaimed} counted"
            EVENTS["pinned host KV entry checked"] += sum(1 for t in host_kv_pins.values() if t > now)
            EVENTS["pinned host KV block promoted with its pin"] += len(back)
            seen["host KV"], seen["host KV reclaimed"] = host_kv_pins, host_kv.pins_reclaimed
        rec = mgr.recurrent
        if rec is None:
            return
        host = rec.host.entries if rec.host is not None else {}
        before, reclaimed, on_host_before = seen.get("states", ({}, 0, set()))
        gone = [h for h in before if h not in rec.pins.until]
        taken = [h for h in gone if before[h] > now]
        # every pin that left every tier before its deadline is counted (once; a finish may pin a key again
        # in the step its state left, so then the count may run ahead of the keys gone)
        assert len(taken) <= rec.pins.reclaimed - reclaimed, \
            f"{len(taken)} pinned states left every tier before their deadline, " \
            f"{rec.pins.reclaimed - reclaimed} counted"
        assert pinning or len(taken) == rec.pins.reclaimed - reclaimed, "a pin counted as lost twice"
        for h, until in rec.pins.until.items():
            assert h in before or pinning, "a state was pinned by a verb that ends no pinned turn"
            # the pin map holds no key that no tier holds: a state that leaves takes its pin along
            assert h in rec.checkpoints or h in host, f"a pin on a state no tier holds (deadline passed: {until <= now})"
            assert not (h in rec.checkpoints and h in host), "a pinned state in two tiers"
            if until > now:
                EVENTS["pinned state checked"] += 1
                EVENTS["pinned state checked on the host"] += h in host
        on_host = {h for h in rec.pins.until if h in host}
        EVENTS["pinned state demoted to host"] += len({h for h in on_host - on_host_before if h in before})
        EVENTS["pinned state reclaimed"] += len(taken)
        stats = mgr.stats().pins  # counts only live pins: those a tier holds before their deadline
        assert stats["states"] == sum(1 for t in rec.pins.until.values() if t > now)
        assert stats["states_on_host"] == sum(1 for h in on_host if rec.pins.until[h] > now)
        seen["states"] = (dict(rec.pins.until), rec.pins.reclaimed, on_host)


class PinnedTurnsHostTierMachine(PinnedTurnsMachine):
    """The same with a host tier on every run (states and KV blocks demoted there, swaps in its budget)."""

    force_host_tier = True


def run_pinned_turns(machine, max_examples: int, steps: int = 50) -> None:
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))


def test_pinned_turns_state_machine(fake_clock):
    # ~7 s on one core; the runs do not depend on PYTHONHASHSEED (checked under 0-5: the same events),
    # but they do on what else the session collected (the whole suite gives other examples than this
    # file alone: 0 block pins reclaimed there, 15 here), so rare events are counted, not required
    EVENTS.clear()
    run_pinned_turns(PinnedTurnsMachine, 150)
    run_pinned_turns(PinnedTurnsHostTierMachine, 40)
    print(dict(EVENTS))
    for what in ["pinned turn", "pinned turn kept a state", "pinned block checked", "pinned state checked",
                 "pinned state reclaimed",
                 "pinned state demoted to host", "pinned state checked on the host",
                 "host demotion", "resumed after swap",
                 "prefix hit"]:
        assert EVENTS[what] > 0, f"the random runs never exercised {what}: {EVENTS}"
    # counted, not required (rare in some sessions' runs; each has a deterministic test): "pinned block
    # reclaimed" and "pinned block expired" (test_block_pool.py::test_pinned_blocks_go_last_and_only_until_their_deadline),
    # "pinned block demoted to host", "pinned host KV entry checked", "pinned host KV block promoted with
    # its pin" (test_host_kv_tier.py)
