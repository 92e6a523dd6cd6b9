"""PrefixRouter (server/router.py): the longest usable prefix wins, load decides otherwise, requests in
flight pull their prefix's followers, and finishing or moving a request updates the load."""
from __future__ import annotations

import random

import pytest

from hybridkv.server.router import PrefixRouter

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_least_loaded_without_a_prefix_then_load_is_released():
    r = PrefixRouter(3, BS)
    a = r.choose("a", _prompt(1, 40), 10, None, [0, 0, 0])
    b = r.choose("b", _prompt(2, 40), 10, None, [0, 0, 0])
    c = r.choose("c", _prompt(3, 40), 10, None, [0, 0, 0])
    assert sorted((a, b, c)) == [0, 1, 2] and r.load == [50, 50, 50]
    r.finished("b")
    assert r.load[b] == 0 and r.choose("d", _prompt(4, 8), 1, None, [0, 0, 0]) == b
    r.finished("b")  # twice is harmless
    assert r.load[b] == 9


def test_the_longest_cached_prefix_wins_over_load_and_dead_replicas_are_skipped():
    r = PrefixRouter(3, BS)
    r.load = [0, 500, 0]
    assert r.choose("x", _prompt(5, 80), 4, None, [16, 48, 32]) == 1
    assert r.choose("y", _prompt(6, 80), 4, None, [16, None, 32]) == 2
    with pytest.raises(ValueError, match="no data-parallel replica"):
        r.choose("z", _prompt(7, 80), 4, None, [None, None, None])


def test_a_prefix_in_flight_pulls_its_followers_unless_salted_apart():
    r = PrefixRouter(2, BS)
    shared = _prompt(8, 64)
    first = r.choose("lead", shared + [1, 2, 3], 8, None, [0, 0])
    assert r.choose("f1", shared + [4, 5], 8, None, [0, 0]) == first  # not yet cached anywhere
    assert r.choose("other-tenant", shared + [4, 5], 8, "salt", [0, 0]) != first  # least loaded
    for rid in ("lead", "f1", "other-tenant"):
        r.finished(rid)
    assert r.load == [0, 0]
    r.load[first] = 100  # finished requests pull nothing: load decides again
    assert r.choose("f2", shared + [6], 8, None, [0, 0]) == 1 - first


def test_moved_carries_the_load_and_prefix():
    r = PrefixRouter(2, BS)
    shared = _prompt(9, 64)
    r.choose("m", shared + [7], 20, None, [0, 0])
    was = r.replica_of("m")
    r.moved("m", 1 - was)
    assert r.replica_of("m") == 1 - was and r.load[1 - was] == 85 and r.load[was] == 0
    assert r.choose("n", shared + [8], 1, None, [0, 0]) == 1 - was
