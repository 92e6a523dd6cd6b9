"""Where each checkpoint policy wants a state kept, as a block boundary in (start, end]."""
from hybridkv.checkpoint_policy import CheckpointPolicy


def test_policies():
    assert CheckpointPolicy("none", 4).due(0, 100, 50, None) is None
    pe = CheckpointPolicy("prompt_end", 4)
    assert pe.due(0, 64, 50, None) == 48 and pe.due(0, 47, 50, None) is None and pe.due(48, 50, 50, None) is None
    # in generated tokens: the latest boundary (rolling, for the next turn of a chat)
    assert pe.due(48, 60, 50, None) == 60 and pe.due(63, 64, 50, None) == 64 and pe.due(64, 65, 50, None) is None
    assert pe.due(0, 16, 48, None) is None and pe.due(0, 44, 48, None) == 44  # (48 - 1) // 4 * 4
    ev = CheckpointPolicy("every_n_blocks", 4, every_n=2)
    assert ev.due(0, 20, 100, None) == 8 and ev.due(8, 20, 100, None) == 16 and ev.due(17, 20, 100, None) is None
    assert ev.due(23, 24, 100, None) == 24  # a decode step landing on a boundary
    bp = CheckpointPolicy("branch_points", 4)
    assert bp.due(0, 64, 50, 12) == 12 and bp.due(12, 64, 50, 12) == 48


def test_shared_burst_boundaries_are_honoured_by_every_policy_but_none():
    for name in ("prompt_end", "every_n_blocks", "branch_points"):
        assert CheckpointPolicy(name, 4, every_n=8).due(0, 64, 50, None, shared=[20]) == 20
    assert CheckpointPolicy("none", 4).due(0, 64, 50, None, shared=[20]) is None
