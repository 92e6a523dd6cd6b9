"""The examples run end to end in their small configurations (as subprocesses, like a user)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the examples run as subprocesses

ROOT = Path(__file__).resolve().parents[2]


def run_example(*args: str, timeout: int = 120, expect_rc: int = 0) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / args[0]), *args[1:]], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def count(pattern: str, text: str) -> list[int]:
    m = re.search(pattern, text)
    assert m, f"no line matching {pattern!r} in:\n{text}"
    return [int(g) for g in m.groups()]


def test_serve_hybrid_tiny():
    out = run_example("serve_hybrid.py", "--tiny", "--max-tokens", "8", timeout=300)
    assert "== generate (greedy) ==" in out and "== stats ==" in out
    assert len(re.findall(r"^\[\d\] '.*' -> .*\(8 tokens, length\)$", out, re.M)) == 4, out
    # the third wave shares the system prompt's 4 blocks (64 character tokens) with the cache
    assert len(re.findall(r"cached 64 prompt tokens", out)) == 3, out
    assert count(r'"prefix_hit_tokens": (\d+)', out)[0] > 0
    assert "leak check: ok" in out
    # the HTTP part: `hybridkv serve` in a subprocess answers the openai client with the Python
    # API's greedy text, plain and streamed, then stops
    greedy = re.search(r"^\[0\] 'The capital of France is' -> (.*) \(8 tokens, length\)$", out, re.M).group(1)
    assert re.search(rf"^completions: 'The capital of France is' -> {re.escape(greedy)} \(8 tokens, length\)$",
                     out, re.M), out
    assert re.search(rf"^streamed:    'The capital of France is' -> {re.escape(greedy)}$", out, re.M), out
    assert "server == Python API: yes" in out and out.rstrip().endswith("server stopped"), out


def test_preemption_stress_small():
    out = run_example("preemption_stress.py", "--small")
    assert "RESULT: PASS" in out and "all identical" in out, out
    recompute, swap = count(r"preemptions: recompute (\d+), swap (\d+)", out)
    assert recompute > 0 and swap > 0, out
    assert count(r"migrations: (\d+)", out)[0] > 0
    assert count(r"forks: (\d+)", out)[0] > 0
    assert count(r"prefix hits: (\d+) tokens", out)[0] > 0
    assert len(re.findall(r"kv_blocks_used 0, state_slots_live 0", out)) == 2, out


def test_preemption_stress_reports_a_broken_swap():
    out = run_example("preemption_stress.py", "--small", "--inject-fault", expect_rc=1)
    assert "RESULT: FAIL" in out and "DIVERGED" in out, out
