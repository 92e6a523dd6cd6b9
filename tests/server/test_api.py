"""The OpenAI-compatible endpoints, driven by the official `openai` client (and httpx for raw SSE):
answers equal offline `LLM.generate`, streams join to the same text, chat formats without a
doubled BOS, bad input is a 400 naming the value, and a missing key a 401."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.server.chat import chat_prompt_ids

from .conftest import http

API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def alone(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_models_and_health(client, chat_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    assert http().get(chat_server.url + "/health").status_code == 200  # no key needed


def test_completion_equals_offline(client, oracle):
    prompt = "Hybrid models mix attention with"
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    ref = alone(oracle, prompt, SamplingParams(max_tokens=12, temperature=0)).outputs[0]
    c = r.choices[0]
    assert c.token_ids == ref.token_ids and c.text == ref.text and c.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(oracle.get_tokenizer()(prompt)["input_ids"])
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompts_and_batches(client, oracle):
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    r = client.completions.create(model="tiny-chat", prompt=prompts, max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    for p, c in zip(prompts, r.choices):
        assert c.token_ids == alone(oracle, p, SamplingParams(max_tokens=6, temperature=0)).outputs[0].token_ids


def test_stream_joins_to_the_non_streamed_text(client):
    kw = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=20, temperature=0)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == full.text
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_raw_sse_ends_with_done_and_reports_usage(chat_server):
    body = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http().stream("POST", chat_server.url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["prompt_tokens"] == 3


def test_n_and_seed_are_reproducible_and_equal_offline(client, oracle):
    kw = dict(model="tiny-chat", prompt=[9, 10, 11, 12], max_tokens=8, temperature=0.9, n=2, seed=5,
              extra_body={"return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ids = [c.token_ids for c in a.choices]
    assert ids == [c.token_ids for c in b.choices] and len(ids) == 2
    ref = alone(oracle, [9, 10, 11, 12], SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=5))
    assert ids == [o.token_ids for o in sorted(ref.outputs, key=lambda o: o.index)]


def test_stop_string_cuts_text_in_both_modes(client):
    kw = dict(model="tiny-chat", prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 1) if text[i:i + 2].strip())
    want = text[:text.index(stop)]
    got = client.completions.create(stop=[stop], **kw).choices[0]
    assert got.text == want and got.finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stop=[stop], stream=True, **kw))
    assert streamed == want


def test_logprobs(client):
    r = client.completions.create(model="tiny-chat", prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and v <= 0 and v == pytest.approx(max(top.values()))  # greedy: the top one
    c = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_streamed_logprobs_cover_every_token_even_while_text_is_held_back(client):
    kw = dict(model="tiny-chat", prompt=[5, 6, 7], max_tokens=12, temperature=0, logprobs=1,
              stop=["a long stop string that never shows up"])  # holds back text the whole way
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.token_logprobs]
    assert streamed == full.choices[0].logprobs.token_logprobs and len(streamed) == 12
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    assert len({ch.created for ch in chunks}) == 1 and len({ch.id for ch in chunks}) == 1


def test_chat_uses_the_template_once(client, oracle, chat_server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    tok = oracle.get_tokenizer()
    ids = chat_prompt_ids(tok, messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # no doubled BOS
    r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    ref = alone(oracle, ids, SamplingParams(max_tokens=10, temperature=0)).outputs[0]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_chat_without_template_or_tokenizer_is_a_clear_400(plain_server, bare_server):
    msg = {"model": "tiny-plain", "messages": [{"role": "user", "content": "hi"}]}
    r = http().post(plain_server.url + "/v1/chat/completions", json=msg)
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    r = http().post(bare_server.url + "/v1/chat/completions", json={**msg, "model": "tiny-bare"})
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
    r = http().post(bare_server.url + "/v1/completions", json={"model": "tiny-bare", "prompt": "hi"})
    assert r.status_code == 400 and "list of token ids" in r.json()["error"]["message"]
    r = http().post(bare_server.url + "/v1/completions",
                   json={"model": "tiny-bare", "prompt": [5, 6], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""  # ids work, no text to show
    assert r.json()["usage"]["completion_tokens"] == 3


BAD = [  # (body changes, words the message must contain)
    ({"model": "gpt-4"}, ["'gpt-4'", "tiny-chat"]),
    ({"max_tokens": -1}, ["max_tokens", "-1"]),
    ({"max_tokens": 0}, ["max_tokens", "0"]),
    ({"prompt": [5] * 600}, ["600 tokens", "512"]),
    ({"prompt": [5] * 500, "max_tokens": 50}, ["max_tokens (50)", "512", "at most 12"]),
    ({"temperature": "hot"}, ["temperature", "'hot'"]),
    ({"temperature": -1}, ["temperature", "-1"]),
    ({"top_p": 2}, ["top_p", "2"]),
    ({"n": 0}, ["n must", "0"]),
    ({"n": 100}, ["n=100", "max_num_seqs 32"]),
    ({"prompt": [5, 100000]}, ["100000", "vocabulary"]),
    ({"prompt": []}, ["empty"]),
    ({"logprobs": 50}, ["logprobs", "50"]),
    ({"presence_penalty": 2.5}, ["presence_penalty", "[-2, 2]", "2.5"]),
    ({"frequency_penalty": -3}, ["frequency_penalty", "[-2, 2]", "-3"]),
    ({"logit_bias": {"500": 1.0}}, ["logit_bias token id 500", "vocabulary [0, 128)"]),
    ({"logit_bias": {"5": 101}}, ["logit_bias[5]", "[-100, 100]", "101"]),
    ({"logit_bias": {"x": 1}}, ["logit_bias key 'x'", "token id"]),
    ({"min_p": 1.5}, ["min_p", "[0, 1]", "1.5"]),
    ({"repetition_penalty": 0}, ["repetition_penalty", "> 0", "0"]),
    ({"min_tokens": 9}, ["min_tokens", "max_tokens (4)", "9"]),
    ({"prompt_logprobs": 21}, ["prompt_logprobs", "[0, 20]", "21"]),
    ({"prompt_logprobs": 1, "stream": True}, ["prompt_logprobs", "stream"]),
    ({"prompt": None}, ["prompt"]),
]


@pytest.mark.parametrize("change,words", BAD, ids=[json.dumps(b[0])[:40] for b in BAD])
def test_bad_completion_requests_are_400_then_service_goes_on(chat_server, change, words):
    body = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 4, **change}
    r = http().post(chat_server.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and all(w in err["message"] for w in words), err
    ok = http().post(chat_server.url + "/v1/completions", headers=AUTH,  # no EOS: exactly 2 tokens
                    json={"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body,words", [
    ('{"model": "tiny-chat", "messages": [', ["not valid JSON"]),
    ('{"model": "tiny-chat", "messages": [{"role": "user"}]}', ["messages[0].content", "Field required"]),
    ('{"model": "tiny-chat", "messages": []}', ["messages is empty"]),
    ('{"model": "tiny-chat", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     ["image_url", "only text"]),
    ('{"model": "tiny-chat", "messages": "hi"}', ["messages", "'hi'"]),
])
def test_bad_chat_requests_are_400(chat_server, body, words):
    r = http().post(chat_server.url + "/v1/chat/completions", content=body,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert all(w in r.json()["error"]["message"] for w in words), r.json()


def test_api_key(chat_server):
    bad = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-chat", prompt=[5, 6], max_tokens=2)
    r = http().post(chat_server.url + "/v1/completions", json={"model": "tiny-chat", "prompt": [5]})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert http().get(chat_server.url + "/metrics").status_code == 200  # scrapers need no key


EXTRAS = dict(presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"20": 2.5, "21": -100},
              seed=11, temperature=0.8)
EXTRA_BODY = dict(min_p=0.02, top_k=40, repetition_penalty=1.2, min_tokens=6, ignore_eos=False)


def test_sampling_extras_equal_offline(client, oracle):
    prompt = [9, 10, 11, 9, 10, 11]
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, **EXTRAS,
                                  extra_body={**EXTRA_BODY, "return_token_ids": True})
    ref = alone(oracle, prompt, SamplingParams(max_tokens=10, **EXTRAS, **EXTRA_BODY)).outputs[0]
    assert r.choices[0].token_ids == ref.token_ids and len(ref.token_ids) >= 6 and 21 not in ref.token_ids
    plain = alone(oracle, prompt, SamplingParams(max_tokens=10, seed=11, temperature=0.8)).outputs[0]
    assert plain.token_ids != ref.token_ids  # the extras changed the draw


def test_stop_reason_in_choices_and_the_last_chunk(client, oracle):
    kw = dict(model="tiny-chat", prompt=[5, 6, 7], max_tokens=8, temperature=0)
    ref = alone(oracle, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0)).outputs[0]
    stop_id = ref.token_ids[2]
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop_id
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"stop_token_ids": [stop_id]}))
    assert chunks[-1].choices[0].stop_reason == stop_id
    length = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert length.choices[0].finish_reason == "length" and length.choices[0].stop_reason is None
    text = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=12, temperature=0).choices[0].message.content
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip())
    c = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=12, temperature=0, stop=["never there", stop])
    assert c.choices[0].finish_reason == "stop" and c.choices[0].stop_reason == stop


def test_prompt_logprobs_and_ranks_equal_offline(client, oracle):
    prompt = [5, 6, 7, 8, 9, 30, 31]
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].prompt_logprobs
    ref = alone(oracle, prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)).prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for pos in range(1, len(prompt)):
        assert {int(t) for t in got[pos]} == set(ref[pos])
        mine = got[pos][str(prompt[pos])]
        assert mine["logprob"] == pytest.approx(ref[pos][prompt[pos]].logprob, abs=1e-5)
        assert mine["rank"] == ref[pos][prompt[pos]].rank and mine["decoded_token"]
    c = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    assert c.prompt_logprobs[0] is None and all(len(e) == 1 for e in c.prompt_logprobs[1:])


@pytest.fixture(scope="module")
def defaults_client(checkpoints, chat_server, tmp_path_factory):
    """A server whose checkpoint's generation_config.json sets top_k=1 (greedy whatever the
    temperature), temperature 0.7 and max_new_tokens 5."""
    path = tmp_path_factory.mktemp("gen-defaults") / "ckpt"
    shutil.copytree(checkpoints["chat"], path)
    cfg = path / "generation_config.json"
    g = json.loads(cfg.read_text()) if cfg.exists() else {}
    cfg.write_text(json.dumps({**g, "top_k": 1, "temperature": 0.7, "max_new_tokens": 5}))
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, memory_budget_bytes=16 << 20)
    server = type(chat_server)(llm, "tiny-defaults")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60), llm
    server.stop()


def test_generation_config_defaults_apply_per_field(defaults_client):
    client, llm = defaults_client
    prompt = [9, 10, 11, 12]
    greedy = alone(llm, prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)).outputs[0].token_ids
    kw = dict(model="tiny-defaults", prompt=prompt, extra_body={"ignore_eos": True, "return_token_ids": True})
    for seed in (1, 2, 3):  # temperature set, top_k not: the file's top_k=1 still holds; max_tokens from the file
        r = client.completions.create(temperature=1.5, seed=seed, **kw)
        assert r.choices[0].token_ids == greedy
    assert len(client.completions.create(max_tokens=8, temperature=1.5, **kw).choices[0].token_ids) == 8
    own_top_k = {**kw, "extra_body": {**kw["extra_body"], "top_k": 0}}
    drawn = [client.completions.create(temperature=1.5, seed=s, **own_top_k).choices[0].token_ids for s in (1, 2, 3)]
    assert any(d != greedy for d in drawn)  # the user's top_k wins over the file's
    chat = client.chat.completions.create(model="tiny-defaults", messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5
