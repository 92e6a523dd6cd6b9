"""AsyncLLM from Python: deltas that join to the offline output, bad input refused before
anything runs, an early exit that aborts, and an engine failure that every caller hears about."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.server.app import create_app
from hybridkv.server.async_llm import AsyncLLM, EngineDeadError

KW = dict(device="cpu", dtype="float32", block_size=16, memory_budget_bytes=8 << 20, max_num_seqs=8)


@pytest.fixture(scope="module")
def plain_llm(checkpoints):
    return LLM(str(checkpoints["plain"]), **KW)


@pytest.fixture
def engine(checkpoints):
    e = AsyncLLM.create(str(checkpoints["plain"]), log_stats_interval=0, **KW)
    yield e
    e.close()


async def _collect(engine, ids, params, rid):
    got: dict[int, list] = {}
    async for d in engine.generate(ids, params, rid):
        seq = got.setdefault(d.index, [[], "", None])
        seq[0] += d.token_ids
        seq[1] += d.text
        seq[2] = d.finish_reason
    return got


def test_deltas_join_to_the_offline_output(engine, plain_llm):
    prompt = plain_llm.get_tokenizer()("Hello, hybrid world")["input_ids"]
    params = SamplingParams(n=2, max_tokens=10, temperature=0.7, seed=1, stop=["zz"])

    async def both():
        return await asyncio.gather(_collect(engine, prompt, params, "a"),
                                    _collect(engine, [5, 6, 7], SamplingParams(max_tokens=6, temperature=0), "b"))

    a, b = asyncio.run(both())
    ref = plain_llm.generate([prompt], params, use_tqdm=False)[0]
    for o in ref.outputs:
        assert a[o.index] == [o.token_ids, o.text, o.finish_reason]
    ref_b = plain_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert b[0][0] == ref_b.outputs[0].token_ids


def test_bad_input_raises_before_anything_runs(engine):
    async def bad():
        async for _ in engine.generate([5, 10 ** 6], SamplingParams(max_tokens=3), "bad"):
            pass

    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(bad())
    s = asyncio.run(engine.stats())
    assert s["waiting"] == s["running"] == 0


def test_leaving_early_aborts_and_frees_memory(engine):
    async def leave():
        async for d in engine.generate([5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True), "x"):
            break
        for _ in range(100):  # the abort runs at the engine's next turn
            s = await engine.stats()
            if s["kv_blocks_used"] == 0 and s["state_slots_live"] == 0:
                return s
            await asyncio.sleep(0.01)
        return s

    s = asyncio.run(leave())
    assert s["aborted"] == 1 and s["kv_blocks_used"] == 0 and s["state_slots_live"] == 0


def _wait_free(engine, timeout=5.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = engine.submit(lambda llm: llm.stats()).result(timeout=10)
        if s["kv_blocks_used"] == 0 and s["state_slots_live"] == 0 and s["running"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.01)


def test_abort_from_another_task_ends_the_iteration(engine):
    async def run():
        st = await engine.add_request([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), "y")

        async def consume():
            return [d async for d in st]

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        st.abort()
        return await asyncio.wait_for(task, 5)

    got = asyncio.run(run())
    assert 0 < sum(len(d.token_ids) for d in got) < 400
    assert _wait_free(engine)["aborted"] == 1


def test_a_caller_whose_event_loop_closed_does_not_kill_the_engine(engine):
    async def orphan():  # adds a request, never reads it, and its loop ends
        await engine.add_request([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), "orphan")

    asyncio.run(orphan())
    s = _wait_free(engine)
    assert engine.dead is None and s["aborted"] == 1 and s["generated_tokens"] < 400
    got = asyncio.run(_collect(engine, [5, 6], SamplingParams(max_tokens=3, temperature=0), "next"))
    assert len(got[0][0]) == 3


class _StepFails:
    """A real LLM whose step() raises from the `after`-th call on (fault injection)."""

    def __init__(self, llm, after: int):
        self._llm, self._left = llm, after

    def step(self):
        self._left -= 1
        if self._left < 0:
            raise RuntimeError("injected step failure")
        return self._llm.step()

    def __getattr__(self, name):
        return getattr(self._llm, name)


def test_an_engine_failure_reaches_every_caller(checkpoints):
    engine = AsyncLLM(_StepFails(LLM(str(checkpoints["plain"]), **KW), after=3), log_stats_interval=0)
    app = create_app(engine, "m")

    async def run():
        with pytest.raises(EngineDeadError, match="injected"):
            await _collect(engine, [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "doomed")
        with pytest.raises(EngineDeadError):
            await _collect(engine, [5, 6], SamplingParams(max_tokens=2), "late")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            health = await c.get("/health")
            r = await c.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 2})
        return health, r

    health, r = asyncio.run(run())
    assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    engine.close()


def test_periodic_stats_line_while_busy(checkpoints, caplog):
    """One line per interval in which the engine stepped, with the interval's throughputs; none
    while idle."""
    import logging
    import re
    import time

    caplog.set_level(logging.INFO, logger="hybridkv.engine")
    e = AsyncLLM.create(str(checkpoints["plain"]), log_stats_interval=0.05, **KW)
    try:
        prompt = list(range(5, 45))
        asyncio.run(_collect(e, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "s"))
        time.sleep(0.3)  # a few idle intervals: at most one more line (the one after the last step)
        lines = [r.getMessage() for r in caplog.records if r.name == "hybridkv.engine"]
        time.sleep(0.3)
        assert len([r for r in caplog.records if r.name == "hybridkv.engine"]) == len(lines), "logged while idle"
    finally:
        e.close()
    pat = (r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
           r"Running: (\d+) reqs, Waiting: 0 reqs, Swapped: 0 reqs, KV cache usage: [\d.]+% \((\d+)/\d+ blocks")
    parsed = [re.fullmatch(pat + r".*", ln) for ln in lines]
    assert lines and all(parsed), lines
    assert sum(float(m.group(1)) for m in parsed) > 0 and sum(float(m.group(2)) for m in parsed) > 0, lines
    last = parsed[-1]
    assert (last.group(3), last.group(4)) == ("0", "0"), lines[-1]  # the line after the end: nothing held
