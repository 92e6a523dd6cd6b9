"""`hybridkv serve` stops cleanly (issue 28): SIGTERM or SIGINT while a stream runs ends that
stream with a finish reason and [DONE], stops every replica and tensor-parallel rank, and the
server exits 0 with no process of its own left, for 1 and 2 replicas and tensor parallel 2."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # spawns servers, replicas and ranks


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every live process (from /proc)."""
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                out.setdefault(int(fields[1]), []).append(int(d.name))
    return out


def descendants(pid: int) -> set[int]:
    kids, found, todo = _children(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]):
    port = free_port()
    cmd = [sys.executable, "-m", "hybridkv", "serve", "--random-tiny", "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--memory-budget-mb", "16", "--max-num-seqs", "8", "--log-level", "info",
           "--log-stats-interval", "0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _kill(proc)
    pytest.fail(f"the server did not start: {proc.stdout.read().decode()[-3000:]}")


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and everything it started
    except ProcessLookupError:
        pass
    proc.wait(10)


def _body(max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny-bamba-random", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream, "return_token_ids": True}


def stream_until_end(url: str, max_tokens: int, got: dict) -> None:
    """A stream; records its chunks, tokens, last finish reason and whether [DONE] came."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=_body(max_tokens, True), timeout=120) as r:
            got["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: "):
                    got["chunks"] = got.get("chunks", 0) + 1
                    for c in json.loads(line[6:]).get("choices", []):
                        got["finish"] = c.get("finish_reason") or got.get("finish")
                        if got["finish"] and "finished_at" not in got:
                            got["finished_at"] = time.monotonic()
                        got["tokens"] = got.get("tokens", 0) + len(c.get("token_ids") or [])
    except httpx.HTTPError as e:
        got["error"] = repr(e)


def _requests_in(url: str) -> float:
    """Requests the server runs or queues, from its /metrics (0 when it does not answer)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("hybridkv:num_requests_running{", "hybridkv:num_requests_waiting{")))


def wait_for_json(url: str, max_tokens: int, got: dict) -> None:
    """A non-streamed request; records its status, finish reason and tokens."""
    try:
        r = httpx.post(url + "/v1/completions", json=_body(max_tokens, False), timeout=120)
        got["status"] = r.status_code
        got["finished_at"] = time.monotonic()
        got["finish"] = r.json()["choices"][0]["finish_reason"]
        got["tokens"] = r.json()["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        got["error"] = repr(e)


# expect_procs: the replicas and ranks it spawns; ctrl_c: the signal goes to the whole process group,
# as a terminal's Ctrl-C does; drain: --shutdown-timeout 60 and requests short enough to finish in
# it (else --shutdown-timeout 0 and requests that cannot: they end with finish_reason "abort"; a
# drain of 1 s let a 500-token request on the random tiny model finish on an idle machine);
# "twice": a 60 s drain cut short by a second signal
@pytest.mark.parametrize("extra,sig,expect_procs,ctrl_c,drain", [
    ([], signal.SIGTERM, 0, False, False),
    ([], signal.SIGINT, 0, False, True),
    ([], signal.SIGTERM, 0, False, "twice"),
    (["--data-parallel-size", "2"], signal.SIGTERM, 2, False, False),
    (["--data-parallel-size", "2"], signal.SIGINT, 2, True, False),
    (["--tensor-parallel-size", "2"], signal.SIGTERM, 1, False, False),
    (["--tensor-parallel-size", "2"], signal.SIGINT, 1, True, False),
], ids=["1-replica-SIGTERM", "1-replica-SIGINT-drained", "1-replica-SIGTERM-twice", "2-replicas-SIGTERM",
        "2-replicas-Ctrl-C", "tp2-SIGTERM", "tp2-Ctrl-C"])
def test_signal_drains_then_stops_every_process(extra, sig, expect_procs, ctrl_c, drain):
    max_tokens = 40 if drain is True else 500
    proc, url = start_server(extra + ["--shutdown-timeout", "60" if drain else "0"])
    try:
        kids = descendants(proc.pid)
        spawned = [k for k in kids if "spawn_main" in _cmdline(k)]  # replicas and ranks, not helpers
        assert len(spawned) == expect_procs, {k: _cmdline(k) for k in kids}
        streamed, waited = {}, {}
        readers = [threading.Thread(target=stream_until_end, args=(url, max_tokens, streamed)),
                   threading.Thread(target=wait_for_json, args=(url, max_tokens, waited))]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 60
        while streamed.get("chunks", 0) < 3 and time.monotonic() < deadline and readers[0].is_alive():
            time.sleep(0.02)
        assert streamed.get("chunks", 0) >= 3, streamed
        while _requests_in(url) < 2 and time.monotonic() < deadline:  # the non-streamed one arrived too
            time.sleep(0.02)  # (on a loaded machine its POST can lag the stream's first chunks)
        kids = descendants(proc.pid)
        signal_at = time.monotonic()
        if ctrl_c:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        if drain == "twice":
            time.sleep(0.5)
            proc.send_signal(sig)
            code = proc.wait(30)  # well before the 60 s drain would end
        else:
            code = proc.wait(90)
        for t in readers:
            t.join(30)
        log = proc.stdout.read().decode()
        assert code == 0, log[-3000:]
        names = {k: _cmdline(k) for k in kids}
        deadline = time.monotonic() + 5  # multiprocessing's resource tracker exits when it reads EOF
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {k: names[k] for k in kids if alive(k)}
        assert not left, f"processes outlived the server: {left}\n{log[-3000:]}"
        assert streamed.get("status") == 200 and streamed.get("done"), streamed
        assert waited.get("status") == 200, waited
        if drain is True:  # both finished their work during the drain
            assert streamed["finish"] == "length" and streamed["tokens"] == max_tokens, streamed
            assert waited["finish"] == "length" and waited["tokens"] == max_tokens, waited
        else:  # no drain (or the drain was cut short): 500 tokens are not done three chunks in ...
            # ... unless a stalled machine let one finish before the signal went (CI once did, with 2
            # replicas: both ended "length" first): such a one says nothing; every other is aborted
            for got in (streamed, waited):
                assert got["finish"] == "abort" or got["finished_at"] < signal_at, (streamed, waited, signal_at)
            if "abort" in (streamed["finish"], waited["finish"]):
                assert "finish_reason 'abort'" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            _kill(proc)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_taken_port_exits_1_with_a_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "hybridkv", "serve", "--random-tiny", "--port", str(port),
                            "--device", "cpu", "--memory-budget-mb", "16", "--log-stats-interval", "0"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 1, p.stderr[-3000:]
    assert "address already in use" in p.stderr and "could not run" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
