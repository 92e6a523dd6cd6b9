"""hybridkv.eviction on its own: which checkpoint each rule gives up."""
import pytest

from hybridkv.eviction import DEFAULT_EVICTION, EVICTION_RULES, check_rule, choose_victim


def lin(p):
    return float(p)


def test_lru_takes_the_least_recently_used():
    assert choose_victim("lru", [900, 16, 500], lin) == 0


def test_flop_keeps_the_states_that_save_more():
    # equal recency spread: the shallow state saves least and goes, although not the oldest
    assert choose_victim("flop", [800, 16, 900, 850], lin) == 1
    # with the same savings, the least recently used goes
    assert choose_victim("flop", [400, 400, 400], lin) == 0


def test_utility_keeps_a_junction_over_deeper_and_newer_leaves():
    # oldest and shallowest, but two continuations share it: every branch resumes there
    positions, branches = [160, 900, 1000, 1100], [3, 0, 0, 0]
    assert choose_victim("utility", positions, lin, branches=branches) == 1
    assert choose_victim("flop", positions, lin) == 0  # without the tree it would go first


def test_utility_gives_up_a_state_something_ran_past():
    # equal savings: not the least recently used, but the one a request continued past
    assert choose_victim("utility", [1000, 1000, 1000], lin, branches=[0, 1, 0]) == 1
    assert choose_victim("flop", [1000, 1000, 1000], lin) == 0


def test_utility_without_the_tree_is_flop():
    for pos in ([800, 16, 900, 850], [5, 3, 9], [100, 100]):
        assert choose_victim("utility", pos, lin) == choose_victim("flop", pos, lin)


def test_single_candidate_and_rule_names():
    assert choose_victim("utility", [64], lin, branches=[5]) == 0
    assert DEFAULT_EVICTION in EVICTION_RULES
    with pytest.raises(ValueError, match="checkpoint_eviction='mru'"):
        check_rule("mru")
