"""Servers under test: uvicorn in a thread on 127.0.0.1 (a free port), each over its own tiny LLM.

`chat_server`: a tiny Bamba whose tokenizer adds a BOS on encode and has a chat template (so a
doubled BOS would show), API key "sk-test". `plain_server`: the stock tiny tokenizer, no chat
template. `bare_server`: no tokenizer at all. `small_limits_server`: the chat checkpoint behind
4 KiB bodies and 4 prompts per request. `oracle`: an offline LLM on the chat checkpoint.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
API_KEY = "sk-test"
LLM_KW = dict(device="cpu", dtype="float32", block_size=16, memory_budget_bytes=16 << 20, max_num_seqs=32)


def _chat_checkpoint(src: Path, dst: Path) -> Path:
    from tokenizers import Tokenizer, processors

    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{'plain': stock tiny Bamba, 'chat': + BOS post-processor + chat template, 'bare': no tokenizer}."""
    from hybridkv.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("server-ckpt")
    plain = make_tiny_checkpoint("bamba", root / "plain")
    bare = root / "bare"
    bare.mkdir()
    for f in plain.iterdir():
        if not f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, bare / f.name)
    return {"plain": plain, "chat": _chat_checkpoint(plain, root / "chat"), "bare": bare}


class ServerThread:
    """uvicorn serving `create_app(AsyncLLM(llm))` on 127.0.0.1:<free port>, stopped by `stop()`."""

    def __init__(self, llm, name: str, api_key=None, limits=None):
        import uvicorn

        from hybridkv.server.app import create_app
        from hybridkv.server.async_llm import AsyncLLM
        from hybridkv.server.request_body import HTTPLimits

        self.llm, self.name = llm, name
        self.engine = AsyncLLM(llm, log_stats_interval=0)
        self.app = create_app(self.engine, name, api_key, limits or HTTPLimits())
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        """LLM.stats() read on the engine thread."""
        return self.engine.submit(lambda llm: llm.stats()).result(timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.close()


def _serve(path: Path, name: str, api_key=None, limits=None):
    from hybridkv import LLM

    return ServerThread(LLM(str(path), **LLM_KW), name, api_key, limits)


@pytest.fixture(scope="session")
def chat_server(checkpoints):
    s = _serve(checkpoints["chat"], "tiny-chat", API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def plain_server(checkpoints):
    s = _serve(checkpoints["plain"], "tiny-plain")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def bare_server(checkpoints):
    s = _serve(checkpoints["bare"], "tiny-bare")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def small_limits_server(checkpoints):
    """The chat checkpoint behind tight HTTP limits: 4 KiB bodies, 4 prompts per request; no key."""
    from hybridkv.server.request_body import HTTPLimits

    s = _serve(checkpoints["chat"], "tiny-chat", limits=HTTPLimits(max_body_bytes=4096, max_prompts=4))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def oracle(checkpoints):
    """An offline LLM on the chat checkpoint: what each prompt gives when run alone."""
    from hybridkv import LLM

    return LLM(str(checkpoints["chat"]), **LLM_KW)


@pytest.fixture(scope="session")
def client(chat_server):
    """The official client on the chat server, one for the session (each new client builds an SSL
    context: ~0.1 s)."""
    import openai

    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def http():
    """One HTTP client for the session's plain requests: `httpx.post` builds a client, SSL context
    included, on every call (~0.1 s, most of a bad request's test)."""
    global _HTTP
    if _HTTP is None:
        import httpx

        _HTTP = httpx.Client(timeout=60)
    return _HTTP


_HTTP = None


def alone(llm, prompt, params):
    """`prompt` run by itself through LLM.generate: its RequestOutput."""
    return llm.generate([prompt], params, use_tqdm=False)[0]


def assert_openai_error(r, status: int, *words: str) -> dict:
    """`r` has `status` and OpenAI's error body, whose message contains `words`."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert all(w in err["message"] for w in words), err
    return err
