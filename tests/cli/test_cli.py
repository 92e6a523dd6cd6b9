"""`python -m hybridkv demo` and `serve` run as a user runs them: subprocesses that exit 0 in seconds."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test runs the CLI as a subprocess

ROOT = Path(__file__).resolve().parents[2]


HEAD = re.compile(r"^\[([\w=\-\[\]]+)\] prompt (\d+) tokens \((\d+) from the prefix cache\) -> (\d+) tokens "
                  r"\((length|stop)\):$", re.M)
KEYWORDS = ("return", "if", "self", "for", "in", "not", "is", "None", "def", "raise", "else", "and", "or")


def demo(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "demo", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def completions(out: str) -> dict[str, str]:
    """Request tag -> the text printed under its header line (the '  | ' lines, gutter removed)."""
    parts = HEAD.split(out)  # [before, tag, prompt, cached, generated, reason, text, tag, ...]
    return {parts[i]: "\n".join(line[4:] for line in parts[i + 5].splitlines() if line.startswith("  | "))
            for i in range(1, len(parts), 6)}


def test_demo_completes_python_prompts_with_the_builtin_model():
    out = demo("--max-tokens", "24")
    assert "hybridkv/tiny-code" in out and "RANDOM" not in out, out
    heads = HEAD.findall(out)
    assert [h[0] for h in heads] == ["first", "follow-up", "n=2[0]", "n=2[1]"], out
    assert all(int(h[3]) == 24 if h[4] == "length" else int(h[3]) <= 24 for h in heads), out
    cached = {h[0]: int(h[2]) for h in heads}
    assert cached["first"] == 0 and cached["follow-up"] > 0, out  # the follow-up hits the prefix cache
    text = completions(out)
    assert text["first"].startswith("def fibonacci(n):\n"), out
    assert text["follow-up"].startswith(text["first"].split("\n")[0] + '\n    """Return the n-th Fibonacci'), out
    assert text["n=2[0]"].startswith("class Stack:") and text["n=2[0]"] != text["n=2[1]"], out
    # readable code: printable text, Python's words, indentation in steps of four spaces
    greedy = text["first"] + "\n" + text["follow-up"]
    assert all(c.isprintable() or c in "\n\t" for c in greedy), out
    assert len(set(re.findall(r"\w+", greedy)) & set(KEYWORDS)) >= 2, out
    indents = [len(line) - len(line.lstrip(" ")) for line in greedy.splitlines() if line.strip()]
    assert sum(i % 4 == 0 for i in indents) >= 0.8 * len(indents), out
    assert re.search(r"KV blocks used 0, cached \d+, total \d+", out), out
    assert re.search(r"state slots live 0, checkpoints \d+, total \d+", out), out
    hit = re.search(r"prefix hits: (\d+) of (\d+) prompt tokens", out)
    # the stats count every hit the lines above show (the follow-up's at least)
    assert hit and int(hit.group(1)) >= cached["follow-up"], out
    assert re.search(r"preemptions \{.*\}", out) and re.search(r"[\d.]+ tokens/s", out), out


def test_demo_on_the_random_tiny_model_says_its_text_is_noise():
    out = demo("--random-tiny", "--max-tokens", "4")
    assert "RANDOM weights" in out, out
    assert [h[0] for h in HEAD.findall(out)] == ["first", "follow-up", "n=2[0]", "n=2[1]"], out


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
    """`hybridkv serve` with no checkpoint: the built-in hybridkv/tiny-code on 127.0.0.1 (in its
    bf16), logs saying so, Python code for a Python prompt, a line per finished request and
    periodic engine stats; Ctrl-C stops it cleanly."""
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
        assert name == "hybridkv/tiny-code"
        r = client.completions.create(model=name, prompt="def fibonacci(n):", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        text = r.choices[0].text  # a function body: a new line, indented
        assert text.startswith("\n    ") and text.isascii(), text
        time.sleep(0.5)  # one stats period
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "serving the built-in hybridkv/tiny-code" in out and "RANDOM" not in out, out
    assert f"http://127.0.0.1:{port}" in out
    assert re.search(r"request cmpl-\w+-0 finished: \d+ prompt tokens \(0 cached\), 5 generated, finish length", out), out
    assert re.search(r"hybridkv.llm: .* on (cpu|cuda:?\d*) in torch.bfloat16: \d+ KV blocks of 16 tokens, \d+ state slots", out), out
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


def test_serve_lists_the_builtin_names_for_an_unknown_one():
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "serve", "hybridkv/tiny-coder", "--port", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "'hybridkv/tiny-coder' is not a built-in model; the built-in names are hybridkv/tiny-code, " \
           "hybridkv/tiny-code-draft" in proc.stderr, proc.stderr


def _serve_until_up(port: int, *args: str) -> subprocess.Popen:
    import time

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", "--port", str(port),
                             "--memory-budget-mb", "16", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up in 90 s"
        time.sleep(0.2)


def test_serve_with_a_disk_cache_answers_from_it_after_a_restart(tmp_path):
    """Issue 26's restart goal as a user meets it: `hybridkv serve --disk-cache DIR`, a prompt,
    Ctrl-C; `serve` again on DIR: the repeated prompt reports cached tokens > 0 and the same text."""
    import signal

    import openai

    prompt = "def fibonacci(n):\n    " + "".join(f"# step {i}: add the two numbers before\n    " for i in range(6))
    answers = []
    for run in range(2):
        port = _free_port()
        proc = _serve_until_up(port, "--disk-cache", str(tmp_path), "--disk-cache-gb", "0.25")
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            r = client.completions.create(model="hybridkv/tiny-code", prompt=prompt, max_tokens=8, temperature=0)
            answers.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text))
        finally:
            proc.send_signal(signal.SIGINT)
            out = proc.communicate(timeout=30)[0]
        assert proc.returncode == 0, out
    (n, cold, text), (n2, cached, text2) = answers
    assert n == n2 > 32 and cold == 0 and cached == (n - 1) // 16 * 16, answers
    assert text2 == text, answers
    assert list(tmp_path.glob("*/state-*.hkv")), "no state entry was written"
