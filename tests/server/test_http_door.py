"""The HTTP door is as strict as the Python one (issue 28): bools are not ints, ranges hold, bodies
that are not UTF-8 / JSON / Unicode, nested too deep, too big or with too many prompts are refused
with OpenAI's error shape, and the server answers a good request after each."""
from __future__ import annotations

import json

import openai
import pytest

from .conftest import assert_openai_error, http

API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
GOOD = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def answers_good(url: str, headers=AUTH) -> None:
    ok = http().post(url + "/v1/completions", json=GOOD, headers=headers)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text


# the list: each was accepted (or a 500) before; the Python API refuses them all
STRICT = [
    *[({field: True}, field) for field in
      ("max_tokens", "n", "seed", "top_k", "priority", "min_tokens", "logprobs", "prompt_logprobs")],
    ({"prompt": [True]}, "prompt[0]"),
    ({"prompt": [[5, True]]}, "prompt[0][1]"),
    ({"top_k": -5}, "top_k"),
    ({"top_k": 10**12}, "top_k"),
    ({"seed": 2**70}, "seed"),
    ({"priority": 2**70}, "priority"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"stream": "yes"}, "stream"),
    ({"stop_token_ids": [False]}, "stop_token_ids"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("change,field", STRICT, ids=[json.dumps(c)[:40] for c, _ in STRICT])
def test_completion_fields_are_strict(chat_server, change, field):
    r = http().post(chat_server.url + "/v1/completions", json={**GOOD, **change}, headers=AUTH)
    err = assert_openai_error(r, 400, field.split("[")[0])
    assert err["type"] == "invalid_request_error"
    answers_good(chat_server.url)


@pytest.mark.parametrize("change,field", [
    ({"max_completion_tokens": True}, "max_completion_tokens"), ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": True, "logprobs": True}, "top_logprobs"), ({"n": True}, "n"), ({"seed": 2**70}, "seed"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": True, "content": "x"}]}, "messages[0].role"),
    ({"add_generation_prompt": 1}, "add_generation_prompt"),
])
def test_chat_fields_are_strict(chat_server, change, field):
    r = http().post(chat_server.url + "/v1/chat/completions", json={**CHAT, **change}, headers=AUTH)
    assert_openai_error(r, 400, field)


RAW = [  # (endpoint, body bytes, status, words)
    ("completions", b'{"model": "tiny-chat", "prompt": "a\\ud800b", "max_tokens": 2}', 400, ["surrogate"]),
    ("completions", b'{"model": "tiny-chat", "prompt": ["ok", "\\udc00"], "max_tokens": 2}', 400, ["surrogate"]),
    ("chat/completions", b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     ["surrogate"]),
    ("completions", b'{"model": "tiny-chat", "prompt": "\xff\xfe"}', 400, ["UTF-8"]),
    ("chat/completions", b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\xc3\x28"}]}', 400,
     ["UTF-8"]),
    ("completions", b'{"model": "tiny-chat", "prompt": [5], "x": ' + b"[" * 10000 + b"]" * 10000 + b"}", 400,
     ["nested deeper"]),
    ("completions", b"[" * 10000, 400, ["nested deeper"]),
    ("completions", b'{"model": "tiny-chat", "prompt": [5]', 400, ["not valid JSON"]),
    ("completions", b"", 400, ["not valid JSON"]),
    ("completions", b'"just a string"', 400, ["JSON object"]),
    ("completions", b'{"model": "tiny-chat", "prompt": [5], "max_tokens": NaN}', 400, ["max_tokens"]),
    ("completions", b'{"model": "tiny-chat", "prompt": [5], "temperature": NaN}', 400, ["temperature", "finite"]),
    ("completions", b'{"model": "tiny-chat", "prompt": [5], "temperature": 1e999}', 400, ["temperature"]),
]


@pytest.mark.parametrize("endpoint,raw,status,words", RAW, ids=[f"{e}:{r[:40]!r}" for e, r, _, _ in RAW])
def test_raw_bodies_get_openai_errors(chat_server, endpoint, raw, status, words):
    r = http().post(f"{chat_server.url}/v1/{endpoint}", content=raw, headers=AUTH)
    assert_openai_error(r, status, *words)
    answers_good(chat_server.url)


def test_unknown_paths_and_methods_are_openai_errors(chat_server):
    assert_openai_error(http().post(chat_server.url + "/v1/nope", json=GOOD, headers=AUTH), 404, "/v1/nope")
    assert_openai_error(http().get(chat_server.url + "/v1/completions", headers=AUTH), 405, "GET")


def test_unknown_fields_are_ignored_with_a_warning(chat_server, caplog):
    with caplog.at_level("WARNING", logger="hybridkv.server"):
        r = http().post(chat_server.url + "/v1/completions", json={**GOOD, "frobnicate": 1}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


def test_body_and_prompt_limits(small_limits_server):
    url = small_limits_server.url
    headers = {"Content-Type": "application/json"}
    assert_openai_error(http().post(url + "/v1/completions", json={**GOOD, "prompt": [[5]] * 5}, headers=headers),
                        400, "5 prompts", "at most 4", "--max-prompts-per-request")
    assert_openai_error(http().post(url + "/v1/completions", json={**GOOD, "prompt": ["hi"] * 5000},
                                   headers=headers), 413, "at most 4096", "--max-body-mb")
    big = json.dumps({**GOOD, "prompt": "x" * 100_000}).encode()
    assert_openai_error(http().post(url + "/v1/completions", content=big, headers=headers), 413, str(len(big)))
    ok = http().post(url + "/v1/completions", json={**GOOD, "prompt": [[5, 6]] * 4}, headers=headers)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
    answers_good(url, headers)


def test_default_prompt_limit(chat_server):
    r = http().post(chat_server.url + "/v1/completions", json={**GOOD, "prompt": ["hi"] * 5000}, headers=AUTH)
    assert_openai_error(r, 400, "5000 prompts", "at most 256")
    answers_good(chat_server.url)


def test_openai_client_sees_the_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt=[5, 6], max_tokens=2, extra_body={"top_k": -5})
    assert "top_k" in str(e.value) and "-5" in str(e.value)


def test_cache_pin_is_taken_and_checked(chat_server):
    """`cache_pin: {"ttl_s": seconds}` (a pinned turn: SamplingParams.cache_pin_ttl_s) is accepted,
    and a bad one is a 400 naming cache_pin."""
    ok = http().post(chat_server.url + "/v1/completions", json={**GOOD, "cache_pin": {"ttl_s": 60}}, headers=AUTH)
    assert ok.status_code == 200, ok.text
    for bad in ({"ttl_s": -1}, {"ttl_s": "60"}, {"ttl_s": True}, {"ttl": 60}, 60):
        r = http().post(chat_server.url + "/v1/completions", json={**GOOD, "cache_pin": bad}, headers=AUTH)
        assert_openai_error(r, 400, "cache_pin")
    answers_good(chat_server.url)
    metrics = http().get(chat_server.url + "/metrics").text
    assert 'hybridkv:cache_pinned_turns_total{model_name="tiny-chat"}' in metrics, metrics[-2000:]
    assert 'hybridkv:cache_pins_reclaimed_total{model_name="tiny-chat",what="blocks"}' in metrics
