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
           "--log-stats-interval", "0", "--shutdown-timeout", "1", *extra]
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


def stream_until_end(url: str, got: dict) -> None:
    """A long stream; records its last finish reason and whether [DONE] came."""
    body = {"model": "tiny-bamba-random", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            got["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: "):
                    got["chunks"] = got.get("chunks", 0) + 1
                    for c in json.loads(line[6:]).get("choices", []):
                        got["finish"] = c.get("finish_reason") or got.get("finish")
    except httpx.HTTPError as e:
        got["error"] = repr(e)


# expect_procs: the replicas and ranks it spawns; ctrl_c: the signal goes to the whole process group,
# as a terminal's Ctrl-C does
@pytest.mark.parametrize("extra,sig,expect_procs,ctrl_c", [
    ([], signal.SIGTERM, 0, False),
    (["--data-parallel-size", "2"], signal.SIGTERM, 2, False),
    (["--data-parallel-size", "2"], signal.SIGINT, 2, True),
    (["--tensor-parallel-size", "2"], signal.SIGTERM, 1, False),
    (["--tensor-parallel-size", "2"], signal.SIGINT, 1, True),
], ids=["1-replica-SIGTERM", "2-replicas-SIGTERM", "2-replicas-Ctrl-C", "tp2-SIGTERM", "tp2-Ctrl-C"])
def test_signal_drains_then_stops_every_process(extra, sig, expect_procs, ctrl_c):
    proc, url = start_server(extra)
    try:
        kids = descendants(proc.pid)
        spawned = [k for k in kids if "spawn_main" in _cmdline(k)]  # replicas and ranks, not helpers
        assert len(spawned) == expect_procs, {k: _cmdline(k) for k in kids}
        got: dict = {}
        reader = threading.Thread(target=stream_until_end, args=(url, got))
        reader.start()
        deadline = time.monotonic() + 60
        while got.get("chunks", 0) < 3 and time.monotonic() < deadline and reader.is_alive():
            time.sleep(0.05)
        assert got.get("chunks", 0) >= 3, got
        kids = descendants(proc.pid)
        if ctrl_c:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        code = proc.wait(90)
        reader.join(30)
        log = proc.stdout.read().decode()
        assert code == 0, log[-3000:]
        names = {k: _cmdline(k) for k in kids}
        deadline = time.monotonic() + 5  # multiprocessing's resource tracker exits when it reads EOF
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {k: names[k] for k in kids if alive(k)}
        assert not left, f"processes outlived the server: {left}\n{log[-3000:]}"
        assert got.get("status") == 200 and got.get("done") and got.get("finish") in ("abort", "length"), got
        assert "Traceback" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            _kill(proc)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
