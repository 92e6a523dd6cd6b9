"""benchmarks/bench_disk_ttft.py, small: after the restart each timed disk request hits the disk
tier with the whole prefix cached and gives the cold request's first token (measure() raises
otherwise); the figures are the run's own (speed is reported by the script, not asserted here)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_disk_ttft  # noqa: E402


@pytest.mark.slow  # loads tiny-code twice and prefills ~9 prompts
def test_disk_requests_hit_the_disk_tier_after_a_restart_with_the_cold_first_token():
    r, summary = bench_disk_ttft.measure([256], repeats=2)
    assert len(r["cold_s"]) == len(r["disk_s"]) == len(r["promotion_s"]) == 2
    assert all(p > 0 for p in r["promotion_s"]), r  # each disk request promoted a state
    wrote = summary["wrote"]
    assert wrote["demotions"] >= 3 and wrote["kv_demotions"] >= 3 * 16 and wrote["write_errors"] == 0, wrote
    assert "ratio disk / cold" in bench_disk_ttft.report(r)
