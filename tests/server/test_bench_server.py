"""benchmarks/bench_server.py runs end to end in its smoke configuration and reports every level."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmark runs as a subprocess with a server

ROOT = Path(__file__).resolve().parents[2]


def test_bench_server_quick(tmp_path):
    plot = tmp_path / "latency.png"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--quick",
                           "--models", "llama", "--plot", str(plot)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["model"], r["concurrency"], r["requests"]) for r in rows] == [("llama", 1, 8), ("llama", 4, 8)]
    for r in rows:
        assert r["out_tok_per_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        # every request streamed all its 32 tokens: output tokens / requests over the same wall time
        assert abs(r["out_tok_per_s"] / r["req_per_s"] - 32) < 1e-6
    assert plot.stat().st_size > 0
