"""benchmarks/bench_tier_ttft.py, small: each timed host request hits the host tier (not the
device) and gives the cold request's first token (measure() raises otherwise); the figures are
the run's own (speed is reported by the script, not asserted here)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tier_ttft  # noqa: E402


@pytest.mark.slow  # loads tiny-code and prefills ~10 prompts (~8 s)
def test_host_requests_hit_the_host_tier_with_the_cold_first_token():
    llm = bench_tier_ttft.make_llm(256)
    r = bench_tier_ttft.measure(llm, 256, repeats=2)
    assert len(r["cold_s"]) == len(r["host_s"]) == len(r["promotion_s"]) == 2
    assert all(p > 0 for p in r["promotion_s"]), r  # each host request promoted a state
    host = llm.stats()["checkpoint_tiers"]["host"]
    assert host["hits"] == 3 and host["refused_corrupt"] == 0, host  # warm-up + 2 repeats
    assert "ratio host / cold" in bench_tier_ttft.report(r)
