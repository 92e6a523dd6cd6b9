"""Data-parallel replicas (server/replicas.py): two engine processes answer as one engine does, a
shared prefix is routed to the replica that caches it, an imbalance migrates running requests
(over gloo and over the pipe) without losing a token, waiting requests move to free seats, an add
whose replica dies goes to the other, and a killed replica fails its requests (no hang) while the
other serves.

The oracle is one offline `LLM` of the same checkpoint (greedy and seeded sampling are the same
on any engine); the server test drives a real `hybridkv serve --data-parallel-size 2` process
with the official openai client. Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.server.news import EngineDeadError
from hybridkv.server.replicas import DataParallelLLM

pytestmark = pytest.mark.slow  # replicas and servers are processes

ROOT = Path(__file__).resolve().parents[2]
KW = dict(device="cpu", dtype="float32", block_size=16, memory_budget_bytes=8 << 20, max_num_seqs=2)
WAIT_S = 60  # the most any one step of a test waits


@pytest.fixture(scope="module")
def one_engine(checkpoints):
    return LLM(str(checkpoints["plain"]), **KW)


@pytest.fixture(scope="module")
def dp(checkpoints):
    """Shared by the tests below in file order; the last one that uses it kills both replicas."""
    engine = DataParallelLLM(str(checkpoints["plain"]), 2, log_stats_interval=0, startup_timeout=240, **KW)
    yield engine
    engine.close()


def _prompts(seed: int, n: int, prefix_len: int = 0, suffix_len: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 120) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 120) for _ in range(suffix_len)] for _ in range(n)]


async def _stream(engine, ids, params, rid) -> tuple[list[int], list[list[int]]]:
    """(all token ids, the token ids of each delta) of one request."""
    deltas = []
    async for d in engine.generate(ids, params, rid):
        deltas.append(list(d.token_ids))
    return [t for d in deltas for t in d], deltas


def _run(engine, prompts, params, tag):
    async def all_of_them():
        return await asyncio.wait_for(asyncio.gather(
            *(_stream(engine, ids, p, f"{tag}-{i}") for i, (ids, p) in enumerate(zip(prompts, params)))), WAIT_S)
    return asyncio.run(all_of_them())


def _offline(llm, prompts, params) -> list[list[int]]:
    return [list(llm.generate([ids], p, use_tqdm=False)[0].outputs[0].token_ids) for ids, p in zip(prompts, params)]


def _stats(engine) -> dict:
    return asyncio.run(asyncio.wait_for(engine.stats(), WAIT_S))


def test_two_replicas_answer_as_one_engine(dp, one_engine):
    prompts = _prompts(1, 6)
    params = [SamplingParams(max_tokens=12, temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i) for i in range(6)]
    before = _stats(dp)["replicas"]
    got = _run(dp, prompts, params, "same")
    assert [g[0] for g in got] == _offline(one_engine, prompts, params)
    after_all = _stats(dp)
    after = after_all["replicas"]
    served = [a["generated_tokens"] - b["generated_tokens"] for a, b in zip(after, before)]
    assert all(s > 0 for s in served), f"the least-loaded rule should use both replicas: {served}"
    # per-tier checkpoint stats are summed over the replicas (server/data_parallel.py)
    assert after_all["checkpoint_tiers"]["device"]["entries"] == sum(
        r["checkpoint_tiers"]["device"]["entries"] for r in after_all["replicas"]), after_all["checkpoint_tiers"]


def test_shared_prefix_lands_on_one_replica_with_one_engines_hit_rate(dp, one_engine):
    prompts = _prompts(2, 5, prefix_len=80)  # a prefix no earlier test used
    waves = [prompts[:1], prompts[1:3], prompts[3:]]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    s0 = one_engine.stats()
    for wave in waves:
        one_engine.generate(wave, params, use_tqdm=False)
    s1 = one_engine.stats()
    one_rate = (s1["prefix_hit_tokens"] - s0["prefix_hit_tokens"]) / (s1["prefix_query_tokens"] - s0["prefix_query_tokens"])
    assert one_rate > 0.5, f"the workload must be one that caching helps: {s0} -> {s1}"

    before = _stats(dp)
    for k, wave in enumerate(waves):
        _run(dp, wave, [params] * len(wave), f"prefix{k}")
    after = _stats(dp)
    queried = [a["prefix_query_tokens"] - b["prefix_query_tokens"] for a, b in zip(after["replicas"], before["replicas"])]
    assert sorted(queried) == [0, sum(len(p) for p in prompts)], f"all on one replica: {queried}"
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert hits / sum(queried) >= one_rate, (hits, sum(queried), one_rate)


@pytest.mark.parametrize("transport", ["gloo", "pipe"])
def test_imbalance_migrates_running_requests_without_losing_a_token(dp, one_engine, transport):
    """A cached prefix sends 4 requests to one replica that runs 2 at a time while the other idles:
    running requests move (KV and state, tensors over gloo or bytes in the pipe; the waiting ones
    stay for their cached prefix) and every stream equals the offline output, once each."""
    prompts = _prompts(3 if transport == "gloo" else 13, 5, prefix_len=64)
    warm = SamplingParams(max_tokens=2, temperature=0.0)
    dp.transport = transport
    _run(dp, prompts[:1], [warm], f"warm-{transport}")
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
    before, moves = _stats(dp)["migrations"], dict(dp.moves)
    got = _run(dp, prompts[1:], params, f"move-{transport}")
    after = _stats(dp)["migrations"]
    assert after["out"] > before["out"] and after["in"] - before["in"] == after["out"] - before["out"], (before, after)
    assert dp.moves["running"] > moves["running"], (moves, dp.moves)
    ref = _offline(one_engine, prompts[1:], params)
    for (tokens, deltas), want, p in zip(got, ref, params):
        assert tokens == want and len(tokens) == p.max_tokens


def test_waiting_requests_move_to_a_replica_with_free_seats(dp, one_engine):
    """Four uncached prompts all routed to replica 0 (replica 1's load biased up), which runs 2 at a
    time: waiting requests move as tokens to replica 1 and every stream equals the offline output.
    The answers are long (96 tokens) so that the two waiting requests wait through many balancer
    looks (one every 50 ms) even on a fast step; at 24 tokens a loaded 2-core machine once ran the
    first pair out between two looks and nothing moved."""
    prompts = _prompts(7, 4)  # 12 tokens: under one block, so no cached prefix can hold them
    params = [SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=96, temperature=0.8, seed=11 + i, ignore_eos=True) for i in range(4)]
    before, moves = _stats(dp)["replicas"], dict(dp.moves)
    with dp._lock:
        dp.router.load[1] += 10 ** 6
    try:
        got = _run(dp, prompts, params, "queued")
    finally:
        with dp._lock:
            dp.router.load[1] -= 10 ** 6
    after = _stats(dp)["replicas"]
    assert dp.moves["waiting"] > moves["waiting"], (moves, dp.moves)
    served = [a["generated_tokens"] - b["generated_tokens"] for a, b in zip(after, before)]
    assert served[1] > 0 and sum(served) == 4 * 96, served
    assert [g[0] for g in got] == _offline(one_engine, prompts, params)


def test_bad_input_is_refused_and_nothing_stays(dp):
    async def bad():
        async for _ in dp.generate([5, 10 ** 6], SamplingParams(max_tokens=3), "bad"):
            pass

    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(asyncio.wait_for(bad(), WAIT_S))
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        DataParallelLLM("unused", 0)
    with pytest.raises(ValueError, match="migration_transport='nccl': give 'gloo' or 'pipe'"):
        DataParallelLLM("unused", 2, migration_transport="nccl")
    s = _stats(dp)
    assert s["running"] == 0 and s["waiting"] == 0 and not dp._streams


def test_leaving_a_stream_early_aborts_it_on_its_replica(dp):
    before = _stats(dp)["aborted"]

    async def first_delta_only():
        async for d in dp.generate(_prompts(6, 1)[0], SamplingParams(max_tokens=300, ignore_eos=True), "early"):
            return d.token_ids

    assert asyncio.run(asyncio.wait_for(first_delta_only(), WAIT_S))
    deadline = time.monotonic() + WAIT_S
    while True:
        s = _stats(dp)
        if s["aborted"] == before + 1 and s["running"] == 0 and s["kv_blocks_used"] == 0:
            break
        assert time.monotonic() < deadline, f"the request still runs after its caller left: {s}"
        time.sleep(0.05)
    assert not dp._streams


def test_an_add_whose_replica_dies_goes_to_the_other_then_fails_clearly_when_none_is_left(dp, one_engine):
    """The last test on `dp`: it kills both replicas. Replica 0, the router's choice (no load, no
    cached prefix), exits at its next add: replica 1 answers as one engine would. A running request
    on replica 1 then moved to the dead replica 0 (as if it died after the balancer's look) stays on
    replica 1 and loses no token. Then replica 1 exits at its next add: a clear error naming both,
    within the time bound, nothing left behind."""
    ids, p = _prompts(8, 1)[0], SamplingParams(max_tokens=8, temperature=0.0)
    assert dp.router.load == [0, 0] and dp.replicas.alive() == [0, 1]
    dp.replicas.send(0, ("exit_on_next_add",))
    t0 = time.monotonic()
    got = _run(dp, [ids], [p], "retry")
    assert got[0][0] == _offline(one_engine, [ids], [p])[0]
    assert dp.replicas.alive() == [1] and "replica 0" in dp.dead and "exit code 3" in dp.dead, dp.dead

    long_ids, long_p = _prompts(10, 1, suffix_len=20)[0], SamplingParams(max_tokens=24, temperature=0.0,
                                                                         ignore_eos=True)
    dp.transport = "gloo"

    async def moved_to_a_dead_replica():
        tokens, moved = [], None
        async for d in dp.generate(long_ids, long_p, "to-the-dead"):
            tokens += d.token_ids
            if moved is None:
                moved = await asyncio.get_running_loop().run_in_executor(None, dp._migrate, 1, 0, 1)
                assert moved == 1 and dp.router.replica_of("to-the-dead") == 1
        return tokens

    assert asyncio.run(asyncio.wait_for(moved_to_a_dead_replica(), WAIT_S)) == _offline(one_engine, [long_ids],
                                                                                       [long_p])[0]
    dp.replicas.send(1, ("exit_on_next_add",))
    with pytest.raises(EngineDeadError, match="(?s)no data-parallel replica is running: .*replica 0.*replica 1"):
        _run(dp, [ids], [p], "none-left")
    assert time.monotonic() - t0 < WAIT_S
    assert dp.replicas.alive() == [] and not dp._streams and dp.router.load == [0, 0]


def test_a_replica_starts_tensor_parallel_ranks_of_its_own(checkpoints, one_engine):
    """tensor_parallel_size=2 inside a data-parallel replica (one, to spare the 2 cores): the
    replica process (not a daemon) starts its rank, answers greedy and seeded requests as one
    engine does, and close() leaves neither process behind."""
    engine = DataParallelLLM(str(checkpoints["plain"]), 1, log_stats_interval=0, startup_timeout=240,
                             tensor_parallel_size=2, **KW)
    replica = engine.replicas._procs[0]
    try:
        ranks = _replica_pids(replica.pid)
        assert len(ranks) == 1 and not replica.daemon, ranks
        prompts = _prompts(9, 2)
        params = [SamplingParams(max_tokens=8, temperature=0.0),
                  SamplingParams(max_tokens=8, temperature=0.9, seed=5)]
        assert [g[0] for g in _run(engine, prompts, params, "tp")] == _offline(one_engine, prompts, params)
    finally:
        engine.close()
    deadline = time.monotonic() + WAIT_S
    while any(map(_running, [replica.pid, *ranks])):
        assert time.monotonic() < deadline, "a replica or its tensor-parallel rank outlived close()"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- a real `hybridkv serve --data-parallel-size 2` ---------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_pids(server_pid: int) -> list[int]:
    """The server's spawned engine processes, oldest (replica 0) first."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"spawn_main" in cmd:
            pids.append(int(d))
    return sorted(pids)


def test_serve_data_parallel_answers_the_openai_client_and_survives_a_killed_replica(checkpoints, one_engine,
                                                                                       tmp_path):
    import openai

    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", str(checkpoints["plain"]), "--port",
                             str(port), "--data-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
                             "--memory-budget-mb", "8", "--max-num-seqs", "2", "--log-stats-interval", "0",
                             "--served-model-name", "tiny"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 240 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        prompts = _prompts(4, 3)
        greedy = SamplingParams(max_tokens=10, temperature=0.0)
        for ids, want in zip(prompts, _offline(one_engine, prompts, [greedy] * 3)):
            r = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert r.choices[0].token_ids == want
        assert 'hybridkv:replica_up{model_name="tiny",replica="1"} 1.0' in httpx.get(f"{base}/metrics").text

        # two long streams, one per replica (least loaded); kill replica 1 while both run
        results: dict[int, object] = {}
        started = [threading.Event(), threading.Event()]

        def stream(k: int, ids: list[int]) -> None:
            got = 0
            try:
                for chunk in client.completions.create(model="tiny", prompt=ids, max_tokens=300, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True}):
                    got += 1
                    started[k].set()
                results[k] = got
            except Exception as e:
                results[k] = e
            finally:
                started[k].set()

        threads = [threading.Thread(target=stream, args=(k, ids), daemon=True)
                   for k, ids in enumerate(_prompts(5, 2))]
        for t in threads:
            t.start()
        assert all(e.wait(WAIT_S) for e in started)
        pids = _replica_pids(proc.pid)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
        errors = [r for r in results.values() if isinstance(r, Exception)]
        assert len(errors) == 1 and "replica 1" in str(errors[0]), results
        assert time.monotonic() - t0 < WAIT_S
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503 and "replica 1" in health.text and "died" in health.text
        r = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True})  # the survivor serves on
        assert r.choices[0].token_ids == _offline(one_engine, prompts[:1], [greedy])[0]
        assert 'hybridkv:replica_up{model_name="tiny",replica="1"} 0.0' in httpx.get(f"{base}/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
    assert not _replica_pids(proc.pid)


def test_serve_refuses_a_data_parallel_size_below_one(checkpoints):
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "serve", str(checkpoints["plain"]), "--port", "1",
                           "--data-parallel-size", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "data_parallel_size=0: give an integer >= 1" in proc.stderr and "Traceback" not in proc.stderr
