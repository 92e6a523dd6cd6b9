"""Under concurrent load and disconnects: streams equal the offline run token for token, a client
that leaves frees its blocks and slot at once, and /metrics tells it all. Bounded: 64 streams of
at most 12 tokens, every wait capped, on 127.0.0.1 only."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridkv import SamplingParams

API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{label=value,...}': value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(server, timeout: float = 5.0) -> dict:
    """Poll the engine until no request holds a KV block or a live slot; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.stats()
        if (s["kv_blocks_used"], s["state_slots_live"], s["running"], s["waiting"]) == (0, 0, 0, 0):
            return s
        assert time.monotonic() < deadline, f"memory still held {timeout}s after the clients left: {s}"
        time.sleep(0.02)


@pytest.mark.slow  # a load test
def test_64_concurrent_streams_equal_offline_and_leavers_free_memory(chat_server, oracle):
    """64 concurrent greedy streams (official AsyncOpenAI client); a quarter of the clients, drawn
    with a fixed seed, walk away after a random number of chunks. Each finished stream equals the
    offline greedy run token for token; afterwards /metrics shows no KV block and no live slot."""
    rng = random.Random(11)
    n = 64
    prompts = [[rng.randrange(5, 90) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    max_tokens = [rng.randrange(4, 13) for _ in range(n)]
    leave_after = {i: rng.randrange(1, max_tokens[i]) for i in rng.sample(range(n), n // 4)}
    for i in leave_after:  # leavers ask for far more than they read: on a loaded machine a short
        max_tokens[i] = 400  # one could finish before its client's close reaches the server
    aborted_before = wait_idle(chat_server)["aborted"]

    async def one(ac, i):
        stream = await ac.completions.create(model="tiny-chat", prompt=prompts[i], max_tokens=max_tokens[i],
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
        ids, chunks = [], 0
        async for ch in stream:
            ids += ch.choices[0].model_extra["token_ids"]
            chunks += 1
            if chunks == leave_after.get(i):
                await stream.close()  # the client walks away mid-stream
                return None
        return ids

    async def run():
        ac = openai.AsyncOpenAI(base_url=chat_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(n))), 60)
        finally:
            await ac.close()

    t0 = time.monotonic()
    got = asyncio.run(run())
    elapsed = time.monotonic() - t0
    stayed = [i for i in range(n) if i not in leave_after]
    assert all(got[i] is None for i in leave_after)
    refs = oracle.generate([prompts[i] for i in stayed],
                           [SamplingParams(max_tokens=max_tokens[i], temperature=0, ignore_eos=True)
                            for i in stayed], use_tqdm=False)
    for i, ref in zip(stayed, refs):
        assert got[i] == ref.outputs[0].token_ids and len(got[i]) == max_tokens[i], \
            f"stream {i} differs from its offline run"
    s = wait_idle(chat_server)
    # the leavers were aborted, not run to their end
    assert s["aborted"] - aborted_before >= len(leave_after) // 2, (s["aborted"], aborted_before)
    m = scrape(chat_server.url)
    assert m["hybridkv:kv_blocks_used"] == 0 and m["hybridkv:state_slots_live"] == 0
    assert m["hybridkv:num_requests_running"] == 0 and m["hybridkv:kv_cache_usage_perc"] == 0
    assert elapsed < 60


def test_disconnect_mid_stream_aborts_at_once(chat_server):
    body = {"model": "tiny-chat", "prompt": [5, 6, 7, 8, 9], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    before = wait_idle(chat_server)["aborted"]
    with httpx.stream("POST", chat_server.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events, then hang up
        assert all(g == "" or g.startswith("data: {") for g in got)
        s = chat_server.stats()
        assert s["running"] == 1 and s["kv_blocks_used"] > 0 and s["state_slots_live"] == 1
    t0 = time.monotonic()
    s = wait_idle(chat_server, timeout=3.0)
    assert s["aborted"] == before + 1, "the request ran to its end instead of being aborted"
    assert s["generated_tokens"] > 0 and time.monotonic() - t0 < 3.0


def test_disconnect_while_waiting_for_a_json_answer_aborts(chat_server):
    body = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    before = wait_idle(chat_server)["aborted"]
    try:
        httpx.post(chat_server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
        raise AssertionError("500 tokens came back in 0.3 s: the test needs a longer request")
    except httpx.TimeoutException:
        pass
    s = wait_idle(chat_server, timeout=3.0)
    assert s["aborted"] == before + 1


def test_metrics_scrape(chat_server, client):
    prompt = list(range(20, 90))  # 70 tokens: a repeat hits the 64-token prefix (4 blocks + state)
    before = scrape(chat_server.url)  # the module's server: earlier tests' requests are in the sums
    for _ in range(2):
        client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0)
    list(client.completions.create(model="tiny-chat", prompt=[5, 6], max_tokens=5, temperature=0, stream=True))
    m = scrape(chat_server.url)
    for name in ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                 "kv_blocks_total", "state_slots_live", "state_slots_checkpoint", "state_slots_total",
                 "num_preemptions_total{mode=recompute}", "num_preemptions_total{mode=swap}",
                 "num_swaps_total", "num_migrations_total{direction=out}", "spec_decode_num_drafts_total",
                 "spec_decode_draft_model_forwards_total", "spec_decode_draft_model_tokens_total{kind=real}",
                 "spec_decode_draft_model_tokens_total{kind=speculative}", "spec_decode_draft_model_evictions_total"]:
        assert "hybridkv:" + name in m, name
    assert m["hybridkv:prefix_cache_hits_total"] >= 64
    assert m["hybridkv:prefix_cache_queries_total"] >= 140
    assert m["hybridkv:state_slots_checkpoint"] >= 1
    assert m["hybridkv:prompt_tokens_total"] >= 142 and m["hybridkv:generation_tokens_total"] >= 13
    assert m["hybridkv:request_success_total{finished_reason=length}"] >= 3
    for h in ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"]:
        assert m[f"hybridkv:{h}_count"] >= 3 and m[f"hybridkv:{h}_sum"] > 0, h
    # this test's requests alone (an earlier test's aborted request has a first token but no e2e latency)
    def grew(name):
        return m[f"hybridkv:{name}_seconds_sum"] - before.get(f"hybridkv:{name}_seconds_sum", 0.0)
    assert grew("e2e_request_latency") >= grew("time_to_first_token") > 0
