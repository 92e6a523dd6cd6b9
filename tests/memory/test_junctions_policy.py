"""The default checkpoint policy, 'junctions', on its own: which boundaries it asks for."""
import pytest

from hybridkv.checkpoint_policy import DEFAULT_POLICY, CheckpointPolicy

J = CheckpointPolicy("junctions", 16)


def test_default_is_junctions():
    assert DEFAULT_POLICY == "junctions" and J.rolling_output and J.keeps_final_state


def test_a_fresh_prompt_keeps_its_prompt_end_however_chunked():
    assert J.due(0, 53, 53, None, resumed_from=0) == 48
    assert J.due(29, 53, 53, None, resumed_from=0) == 48       # second chunk of a chunked prefill
    assert J.due(2048, 3000, 3000, None, resumed_from=0) == 2992
    # resume point unknown: a chunk off a block boundary or of 256+ tokens is a fresh prefill's
    assert J.due(29, 53, 53, None) == 48 and J.due(2048, 3000, 3000, None) == 2992


def test_a_short_tail_after_a_deep_hit_keeps_no_prompt_end():
    # a few-shot query resuming from its task's junction: its prompt end serves only a repeat
    assert J.due(960, 1030, 1030, None, resumed_from=960) is None
    assert J.due(960, 1030, 1030, None) is None
    assert CheckpointPolicy("branch_points", 16).due(960, 1030, 1030, None) == 1024
    # the second query of a task: cut at the junction it found, then no prompt end past it
    assert J.due(0, 1030, 1030, 960, resumed_from=0) == 960
    assert J.due(960, 1030, 1030, 960, resumed_from=0) is None
    assert J.due(512, 560, 560, None, shared=[512], resumed_from=0) is None  # a burst leader's tail


def test_junctions_bursts_and_output_states_are_kept():
    assert J.due(0, 1030, 1030, 704, resumed_from=0) == 704      # junction before the prompt end
    assert J.due(960, 1030, 1030, 1008, resumed_from=960) == 1008
    assert J.due(0, 600, 600, None, shared=[512], resumed_from=0) == 512
    assert J.due(1039, 1040, 1030, None, resumed_from=960) == 1040  # the rolling output state
    assert CheckpointPolicy("none", 16).due(0, 600, 600, 304, shared=[512]) is None


def test_a_fresh_prompt_leaves_a_trail_when_a_host_tier_can_hold_it():
    T = CheckpointPolicy("junctions", 16, trail=3)
    # prompt end 160 (10 blocks): 3 states evenly spread before it, every 3 blocks
    cuts, start = [], 0
    while (b := T.due(start, 161, 161, None, resumed_from=0)) is not None:
        cuts.append(b)
        start = b
    assert cuts == [48, 96, 144, 160]
    # a prompt that found a junction or leads a burst keeps its state there and no trail past it
    assert [T.due(s, 161, 161, 64, resumed_from=0) for s in (0, 64)] == [64, 160]
    assert [T.due(s, 161, 161, None, shared=[80], resumed_from=0) for s in (0, 80)] == [80, 160]
    # a prompt that resumed from a state keeps no trail (its tail is its own); nor does another
    # policy, nor 'junctions' without a host tier
    assert T.due(960, 1030, 1030, None, resumed_from=960) is None
    assert CheckpointPolicy("branch_points", 16, trail=3).due(0, 161, 161, None) == 160
    assert J.due(0, 161, 161, None, resumed_from=0) == 160
    # a prompt too short to spread over: its prompt end alone
    assert T.due(0, 20, 20, None, resumed_from=0) == 16


def test_a_negative_trail_is_refused():
    with pytest.raises(ValueError, match="trail=-1"):
        CheckpointPolicy("junctions", 16, trail=-1)
