"""benchmarks/bench_prefix.py: the model-free replay counts hits exactly, and the policy study holds."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_prefix  # noqa: E402
from bench_prefix import make_manager  # noqa: E402
from replay import replay  # noqa: E402
from traces import agent_sessions, few_shot, short_prefixes  # noqa: E402

BS = 16


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _oracle_hits(trace, boundaries):
    """Serial replay oracle: request i hits the deepest boundary b of an earlier request's computed
    tokens (prompt + output minus the last, never-computed token) with b <= common prefix and
    b <= len(prompt_i) - 1. `boundaries(prompt_len, computed)` lists where that request left states."""
    done, hits = [], []
    for t in trace:
        limit = len(t.prompt) - 1
        best = 0
        for seq, bounds in done:
            common = min(_lcp(t.prompt, seq), limit)
            best = max([best] + [b for b in bounds if b <= common])
        hits.append(best)
        seq = t.prompt + t.output[:-1]
        done.append((seq, boundaries(len(t.prompt), len(seq))))
    return hits


@pytest.mark.parametrize("policy,boundaries", [
    ("every_1_blocks", lambda p, c: range(BS, c + 1, BS)),
    # prompt end, the rolling checkpoint at the last boundary inside the output, the final state
    ("prompt_end", lambda p, c: [(p - 1) // BS * BS] + ([c // BS * BS] if c // BS * BS > p else [])
     + ([c] if c % BS == 0 else [])),
])
def test_serial_replay_hits_equal_oracle(policy, boundaries):
    # one request at a time, slots for every checkpoint: the hits are what the policy promises
    trace = agent_sessions(num_sessions=3, turns=3, system_len=90, seed=5)
    trace += few_shot(num_tasks=2, queries_per_task=3, prefix_len=(40, 200), seed=6)
    mgr = make_manager(policy, checkpoint_slots=400, max_num_seqs=1)
    res = replay(mgr, trace, max_num_seqs=1)
    # with one open session at a time the replay runs the trace in list order, as the oracle does
    assert [h for _, h in res.hits] == _oracle_hits(trace, boundaries)
    s = mgr.stats()
    assert s.kv_blocks_used == 0 and s.slots_live == 0 and s.running_requests == 0


def test_branch_points_at_least_prompt_end_on_agent_trace():
    # holds from 8 checkpoint slots up; below that branch_points' extra states evict useful ones
    # (BENCHMARKS.md, "Prefix-cache policies")
    trace = agent_sessions(num_sessions=8, turns=3)
    for slots in (8, 32):
        rates = {p: replay(make_manager(p, slots, 4), trace, max_num_seqs=4).hit_rate
                 for p in ("prompt_end", "branch_points")}
        assert rates["branch_points"] >= rates["prompt_end"], (slots, rates)
    assert rates["branch_points"] > 0.3


def test_short_prefixes_hit_only_with_block_16():
    trace = short_prefixes(num_prefixes=4, requests_per_prefix=4)
    assert all(len(t.prompt) < 528 + 100 for t in trace)
    bp = replay(make_manager("branch_points", 16, 4), trace, max_num_seqs=4)
    align = replay(make_manager("align528", 16, 4), trace, max_num_seqs=4)
    assert align.hit_tokens == 0  # no shared prefix reaches one 528-token page
    assert any(0 < h < 528 for _, h in bp.hits) and bp.hit_rate > 0.1


def test_flops_saved_counts_bamba_9b_parameters():
    cfg = bench_prefix.load_config(bench_prefix.MODEL_CONFIG)
    n = bench_prefix.non_embedding_params(cfg)
    # Bamba-9B has 9.78e9 parameters; embedding and LM head are 2 x 128256 x 4096 of them
    assert abs(n + 2 * 128256 * 4096 - 9.78e9) < 0.01e9
    saved = bench_prefix.flops_saved_fn(cfg, n)
    assert saved(0) == 0
    assert saved(1000) == pytest.approx(2 * n * 1000 + 2 * 3 * 32 * 128 * 1000 ** 2)


def test_main_small_writes_report_and_plot(tmp_path):
    report = bench_prefix.main(["--small", "--out", str(tmp_path)])
    rows = report["rows"]
    assert len(rows) == 3 * len(bench_prefix.POLICIES) * len(report["budgets"])
    assert all(r["hit_rate"] == 0 for r in rows if r["policy"] == "none")
    assert json.loads((tmp_path / "results.json").read_text())["budgets"] == report["budgets"]
    assert "| agent | branch_points |" in (tmp_path / "results.md").read_text()
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "hit_rate.png")
    assert img.shape[0] > 200 and img.shape[1] > 600
