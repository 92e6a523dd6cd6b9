"""`python -m hybridkv demo` runs as a user runs it: a subprocess that exits 0 in seconds."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test runs the CLI as a subprocess

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
    # the stats count every hit the lines above show (the follow-up's at least)
    assert hit and int(hit.group(1)) >= cached["follow-up"], out
    assert re.search(r"preemptions \{.*\}", out) and re.search(r"[\d.]+ tokens/s", out), out


def test_version():
    from hybridkv import __version__

    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"hybridkv {__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(__version__)}"$', pyproject, re.M)


def test_unknown_command_is_refused():
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "nonsense"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_the_openai_client_then_stops_on_ctrl_c():
    """`hybridkv serve` with no checkpoint: the tiny random model on 127.0.0.1, logs saying so,
    a line per finished request and periodic engine stats; Ctrl-C stops it cleanly."""
    import signal
    import time

    import httpx
    import openai

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", "--port", str(port),
                             "--memory-budget-mb", "16", "--log-stats-interval", "0.2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 90 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        r = client.completions.create(model=name, prompt="Hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        time.sleep(0.5)  # one stats period
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "RANDOM weights" in out and f"http://127.0.0.1:{port}" in out
    assert re.search(r"request cmpl-\w+-0 finished: 5 prompt tokens \(0 cached\), 5 generated, finish length", out), out
    assert re.search(r"hybridkv.llm: .* on (cpu|cuda:?\d*) in torch.float32: \d+ KV blocks of 16 tokens, \d+ state slots", out), out
    assert re.search(r"hybridkv.engine: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                     r"[\d.]+ tokens/s, Running: 0 reqs, Waiting: 0 reqs, Swapped: 0 reqs, KV cache usage: "
                     r"0.0% \(0/\d+ blocks", out), out


def test_serve_refuses_a_missing_checkpoint_with_a_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "serve", str(tmp_path / "nope"), "--port", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_names_a_model_id_missing_from_the_offline_cache(tmp_path):
    import os

    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "serve", "some-org/absent-model", "--port", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    where = str(tmp_path / "hf" / "hub" / "models--some-org--absent-model")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "'some-org/absent-model' is neither a checkpoint directory nor a model id" in proc.stderr
    assert where in proc.stderr and "never downloads" in proc.stderr
