"""HTTP fuzz (issue 28): hypothesis writes request bodies for both endpoints (every field, with
plausible and hostile values: bools, huge ints, NaN, lone surrogates, deep nesting, wrong types)
and mutates the bytes of good ones (flips, cuts, inserts, invalid UTF-8, oversized bodies). Each
example is a batch of bodies sent at once over a chat checkpoint with a template; every answer
must be < 500 (a 4xx in OpenAI's error shape, a 200 that is a whole JSON answer or an SSE stream
ending in [DONE] with no error event), no connection may drop, and a good request is answered
after every batch.

    HYBRIDKV_HTTP_FUZZ_BODIES=10000 pytest -q tests/server/test_http_fuzz.py -s   # the issue's goal
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import LLM_KW, ServerThread, assert_openai_error

BODIES = int(os.environ.get("HYBRIDKV_HTTP_FUZZ_BODIES", "240"))
BATCH = 8
MODEL = "tiny-chat"
HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def fuzz_server(checkpoints):
    """The chat checkpoint with max_model_len 64 (valid bodies stay cheap) and 64 KiB bodies."""
    from hybridkv import LLM
    from hybridkv.server.request_body import HTTPLimits

    llm = LLM(str(checkpoints["chat"]), **{**LLM_KW, "max_num_seqs": 4, "max_model_len": 64})
    s = ServerThread(llm, MODEL, limits=HTTPLimits(max_body_bytes=64 << 10, max_prompts=8))
    yield s
    s.stop()


# ---- values ----------------------------------------------------------------------------------
surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)
texts = st.one_of(st.text(max_size=12), st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), surrogates,
                                                  st.text(max_size=4)))
ints = st.one_of(st.integers(-3, 140), st.integers(), st.sampled_from([2**31, 2**63, 2**64, 2**70, -(2**63) - 1]))
floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(texts, c, max_size=3),
                        max_leaves=8)


def weighted(*pairs):
    """One of the strategies, picked with the given weights: ((weight, strategy), ...)."""
    return st.sampled_from([s for w, s in pairs for _ in range(w)]).flatmap(lambda s: s)


def field(*plausible):
    """Mostly a plausible value, sometimes anything at all."""
    return weighted((6, st.one_of(*plausible)), (1, anything))


tokens = st.lists(st.integers(-2, 140), min_size=0, max_size=12)
SAMPLING = {
    "n": field(st.integers(0, 5)), "temperature": field(st.floats(-1, 3)), "top_p": field(st.floats(0, 1.5)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": field(texts, st.lists(texts, max_size=3)), "seed": field(ints),
    "presence_penalty": field(st.floats(-3, 3)), "frequency_penalty": field(st.floats(-3, 3)),
    "logit_bias": field(st.dictionaries(st.integers(-1, 200).map(str), st.floats(-150, 150), max_size=3)),
    "user": field(texts), "top_k": field(ints), "min_p": field(st.floats(-0.5, 1.5)),
    "repetition_penalty": field(st.floats(-1, 3)), "min_tokens": field(st.integers(-1, 20)),
    "prompt_logprobs": field(st.integers(-1, 25)), "ignore_eos": field(st.booleans()),
    "stop_token_ids": field(tokens), "priority": field(ints), "cache_salt": field(texts),
    "return_token_ids": field(st.booleans()), "max_tokens": field(st.integers(-1, 80), st.none()),
    "tools": field(st.just([])), "response_format": field(st.just({"type": "text"})),
    "frobnicate": anything,  # a field nobody knows
}
model = weighted((8, st.just(MODEL)), (1, anything))
prompt = field(texts, tokens, st.lists(texts, max_size=10), st.lists(tokens, max_size=10))
completion = st.fixed_dictionaries({"model": model, "prompt": prompt}, optional={
    **SAMPLING, "logprobs": field(st.integers(-1, 25)), "echo": field(st.booleans()),
    "best_of": field(st.integers(0, 3)), "suffix": field(texts)})
content = st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                                          optional={"text": field(texts)}), max_size=3))
message = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "assistant", "system"])),
                                 "content": field(content)}, optional={"name": field(texts)})
chat = st.fixed_dictionaries({"model": model, "messages": field(st.lists(message, max_size=4))}, optional={
    **SAMPLING, "max_completion_tokens": field(st.integers(-1, 80)), "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(-1, 25)), "add_generation_prompt": field(st.booleans()),
    "chat_template_kwargs": field(st.dictionaries(texts, anything, max_size=2))})


def encode(body, ascii_only: bool) -> bytes:
    """JSON bytes; with ascii_only False a lone surrogate goes out as (invalid) UTF-8 bytes."""
    return json.dumps(body, allow_nan=True, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw, bodies) -> bytes:
    """A body's bytes, then a few edits: flip, cut, insert, delete, splice in nesting or junk."""
    raw = bytearray(encode(draw(bodies), True))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete", "nest", "junk"]))
        if op == "flip" and i < len(raw):
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del raw[i:]
        elif op == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del raw[i:i + draw(st.integers(1, 8))]
        elif op == "nest":
            raw[i:i] = b"[" * draw(st.sampled_from([50, 199, 201, 10_000]))
        else:
            raw[i:i] = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800", b"NaN", b"\x00"]))
    return bytes(raw)


def sendable(endpoint: str):
    bodies = completion if endpoint == "completions" else chat
    return st.tuples(st.just(endpoint), weighted(
        (10, st.builds(encode, bodies, st.booleans())),
        (6, mutated(bodies)),
        (1, st.integers(60_000, 80_000).map(lambda k: encode({"model": MODEL, "prompt": "x" * k}, True))),
    ))


batch = st.lists(st.one_of(sendable("completions"), sendable("chat/completions")), min_size=BATCH, max_size=BATCH)


class Tally:
    def __init__(self):
        self.bodies, self.by_status, self.resets, self.bad_shape = 0, {}, 0, 0


def check(client: httpx.Client, url: str, endpoint: str, raw: bytes, tally: Tally) -> None:
    """Send one body; assert the answer is well-formed and below 500."""
    try:
        with client.stream("POST", f"{url}/v1/{endpoint}", content=raw, headers=HEADERS) as r:
            text = r.read().decode()
    except httpx.TransportError as e:
        tally.resets += 1
        raise AssertionError(f"connection dropped on {raw[:200]!r}: {e!r}") from None
    tally.bodies += 1
    tally.by_status[r.status_code] = tally.by_status.get(r.status_code, 0) + 1
    assert r.status_code < 500, (r.status_code, text[:500], raw[:300])
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in text.split("\n") if line]
        assert events and events[-1] == "data: [DONE]", (text[-300:], raw[:300])
        assert not any('"error"' in e for e in events), (text[-500:], raw[:300])
    else:
        assert r.status_code == 200 and "choices" in json.loads(text), (text[:300], raw[:300])


@pytest.mark.slow  # about 30 s for the default 240 bodies on 2 busy cores
def test_http_fuzz_no_5xx_no_reset(fuzz_server):
    url, tally = fuzz_server.url, Tally()
    good = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(BATCH) as pool:

        @settings(max_examples=max(1, BODIES // BATCH), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(batch)
        def run(bodies):
            for f in [pool.submit(check, client, url, e, raw, tally) for e, raw in bodies]:
                f.result()
            ok = client.post(url + "/v1/completions", json=good)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text

        run()
    counts = dict(sorted(tally.by_status.items()))
    print(f"\nHTTP fuzz: {tally.bodies} bodies, {tally.resets} resets, status counts {counts}")
    assert tally.resets == 0 and not any(s >= 500 for s in tally.by_status)
    assert fuzz_server.stats()["kv_blocks_used"] == 0  # every request that ran gave its memory back
