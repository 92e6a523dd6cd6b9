"""benchmarks/bench_engine.py in its quick configuration: both parts run against the engine as it
is (they time the model runner's model and batch builder), and our greedy tokens equal
transformers'."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_engine  # noqa: E402


@pytest.mark.slow
def test_bench_engine_quick_runs_and_matches_transformers(tmp_path):
    out = tmp_path / "results.json"
    assert bench_engine.main(["--quick", "--only", "batch1-bamba", "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    (w,) = results["workloads"]
    assert w["workload"] == "batch1-bamba" and w["same_greedy"] == w["requests"] == 1
    assert w["forward_ms_per_step"] > 0 and w["cpu_ratio"][0] > 0
    over = results["overhead"]
    assert over["num_reqs"] == 32 and over["step_ms"] > over["core_ms"] > 0
