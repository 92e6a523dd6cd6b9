"""`python -m hybridkv demo` runs as a user runs it: a subprocess that exits 0 in seconds."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_reports():
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "demo", "--max-tokens", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert "RANDOM weights" in out
    # every request printed its token ids, n=2 as two sequences
    tags = re.findall(r"^\[([\w=\-\[\]]+)\] prompt (\d+) tokens \((\d+) from the prefix cache\) -> (\d+) tokens "
                      r"\(length\): \[[\d, ]+\]$", out, re.M)
    assert [t[0] for t in tags] == ["first", "follow-up", "n=2[0]", "n=2[1]", "long"], out
    assert [int(t[3]) for t in tags] == [8, 8, 8, 8, 32], out
    cached = {t[0]: int(t[2]) for t in tags}
    assert cached["first"] == 0 and cached["follow-up"] > 0, out  # the follow-up hits the prefix cache
    assert re.search(r"KV blocks used 0, cached \d+, total \d+", out), out
    assert re.search(r"state slots live 0, checkpoints \d+, total \d+", out), out
    hit = re.search(r"prefix hits: (\d+) of (\d+) prompt tokens", out)
    assert hit and int(hit.group(1)) == cached["follow-up"], out
    assert re.search(r"preemptions \{.*\}", out) and re.search(r"[\d.]+ tokens/s", out), out


def test_unknown_command_is_refused():
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "nonsense"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
