"""Where each checkpoint policy wants a state kept, as a block boundary in (start, end]."""
import random

from hybridkv.checkpoint_policy import POLICIES, CheckpointPolicy


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


def _first_output_boundary(name, bs, every_n, start, end, num_prompt_tokens, branch_point):
    """By brute force over (start, end]: the first position any rule of `name` wants once the
    prompt lies behind and no burst shares a boundary (the prompt end is never in range)."""
    latest = end // bs * bs
    for b in range(start + 1, end + 1):
        if name in ("prompt_end", "branch_points", "junctions") and b == latest and b > num_prompt_tokens:
            return b
        if name in ("branch_points", "junctions") and b == branch_point:
            return b
        if name == "every_n_blocks" and b % (every_n * bs) == 0:
            return b
    return None


def test_due_past_the_prompt_matches_brute_force_and_the_general_rule():
    """due() for chunks past the prompt without shared boundaries (a decode's case, answered
    without building lists) against brute force, and against the general rule, reached by a
    shared boundary that lies outside the chunk."""
    rng = random.Random(0)
    for name in POLICIES:
        for bs, every_n in ((4, 2), (16, 1), (16, 4)):
            policy = CheckpointPolicy(name, bs, every_n)
            for _ in range(400):
                prompt = rng.randint(1, 80)
                start = rng.randint(prompt, 120)
                end = start + rng.choice([1, 1, 1, 2, bs, 3 * bs + 1])
                bp = rng.choice([None, rng.randint(1, 140) // bs * bs, rng.randint(start, end)])
                resumed = rng.choice([None, 0, prompt // bs * bs])
                got = policy.due(start, end, prompt, bp, resumed_from=resumed)
                assert got == _first_output_boundary(name, bs, every_n, start, end, prompt, bp)
                if start:
                    assert got == policy.due(start, end, prompt, bp, shared=[start], resumed_from=resumed)
