"""Synthetic but realistic request traces for the prefix-cache study (token ids only, no model).

(Named traces.py, not trace.py, so it never shadows the standard library's `trace` module.)

    agent_sessions(...)     multi-turn agents: one system prompt shared by every session; turn t's
                            prompt = turn t-1's prompt + its output + a new user message
    few_shot(...)           a few task prefixes (instructions + k examples), each shared by many queries
    short_prefixes(...)     shared prefixes shorter than 528 tokens (vLLM align-mode's page size)
    burst(...)              many requests sharing one cold system prompt, all arriving at once
    multi_tenant_chat(...)  tenants with their own instructions after a common preamble, each with
                            several multi-turn chats, interleaved; salted tenants share nothing

A `TraceRequest` carries its prompt and the output the stand-in model will "generate"; requests
of one session run one after another (each turn needs the previous turn's output). How many
sessions are open at once is the replay's `max_active` (a burst opens them all).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

VOCAB = 50_000


@dataclass(frozen=True)
class TraceRequest:
    """prompt: token ids; output: the tokens the replay appends as generated (len = max_tokens);
    session: requests with the same session run in list order, the next after the previous ends;
    cache_salt: the tenant's salt (requests with different salts never share a cached prefix)."""

    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    session: Optional[str] = None
    cache_salt: Optional[str] = None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def agent_sessions(num_sessions: int = 12, turns: int = 5, system_len: int = 700,
                   user_len: tuple[int, int] = (30, 200), output_len: tuple[int, int] = (40, 160),
                   seed: int = 0) -> list[TraceRequest]:
    """`num_sessions` x `turns` requests. All sessions share one `system_len`-token system prompt."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    out = []
    for s in range(num_sessions):
        history = list(system)
        for t in range(turns):
            history += _tokens(rng, rng.randint(*user_len))
            reply = _tokens(rng, rng.randint(*output_len))
            out.append(TraceRequest(f"agent{s}.{t}", tuple(history), tuple(reply), f"agent{s}"))
            history += reply
    return out


def few_shot(num_tasks: int = 4, queries_per_task: int = 10, prefix_len: tuple[int, int] = (600, 1500),
             query_len: tuple[int, int] = (20, 120), output_len: tuple[int, int] = (8, 48),
             seed: int = 1) -> list[TraceRequest]:
    """`num_tasks` few-shot prefixes, each followed by `queries_per_task` distinct queries,
    interleaved across tasks (as they would arrive at a shared server)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(*prefix_len)) for _ in range(num_tasks)]
    out = []
    for q in range(queries_per_task):
        for t, prefix in enumerate(prefixes):
            prompt = prefix + _tokens(rng, rng.randint(*query_len))
            out.append(TraceRequest(f"fewshot{t}.{q}", tuple(prompt), tuple(_tokens(rng, rng.randint(*output_len)))))
    return out


def short_prefixes(num_prefixes: int = 6, requests_per_prefix: int = 8, prefix_len: tuple[int, int] = (64, 500),
                   suffix_len: tuple[int, int] = (10, 100), output_len: tuple[int, int] = (8, 48),
                   seed: int = 2) -> list[TraceRequest]:
    """Shared prefixes of 64..500 tokens (all < 528), interleaved; no prefix reaches a 528 page."""
    if prefix_len[1] >= 528:
        raise ValueError(f"prefix_len upper bound {prefix_len[1]} must stay below 528 tokens")
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(*prefix_len)) for _ in range(num_prefixes)]
    out = []
    for q in range(requests_per_prefix):
        for p, prefix in enumerate(prefixes):
            prompt = prefix + _tokens(rng, rng.randint(*suffix_len))
            out.append(TraceRequest(f"short{p}.{q}", tuple(prompt), tuple(_tokens(rng, rng.randint(*output_len)))))
    return out


def burst(num_requests: int = 32, system_len: int = 512, own_len: tuple[int, int] = (20, 60),
          output_len: tuple[int, int] = (8, 48), seed: int = 4) -> list[TraceRequest]:
    """`num_requests` requests = one cold `system_len`-token system prompt + their own tokens.
    Replay it with max_active >= num_requests: they all arrive before the first step."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    return [TraceRequest(f"burst{i}", tuple(system + _tokens(rng, rng.randint(*own_len))),
                         tuple(_tokens(rng, rng.randint(*output_len)))) for i in range(num_requests)]


def multi_tenant_chat(num_tenants: int = 4, chats_per_tenant: int = 3, turns: int = 4, common_len: int = 300,
                      tenant_len: tuple[int, int] = (100, 400), user_len: tuple[int, int] = (20, 120),
                      output_len: tuple[int, int] = (40, 160), salted: tuple[int, ...] = (2, 3),
                      seed: int = 5) -> list[TraceRequest]:
    """`num_tenants` tenants; tenant k's prompt = a `common_len`-token preamble every tenant uses +
    its own instructions; each tenant runs `chats_per_tenant` chats of `turns` turns (turn t's
    prompt = turn t-1's prompt + its output + a new user message). Tenants in `salted` send
    cache_salt = their name, so they reuse only their own prefixes. Chats are interleaved
    across tenants (chat c of every tenant, then chat c + 1)."""
    rng = random.Random(seed)
    common = _tokens(rng, common_len)
    heads = [common + _tokens(rng, rng.randint(*tenant_len)) for _ in range(num_tenants)]
    out = []
    for c in range(chats_per_tenant):
        for k, head in enumerate(heads):
            salt = f"tenant{k}" if k in salted else None
            history = list(head)
            for t in range(turns):
                history += _tokens(rng, rng.randint(*user_len))
                reply = _tokens(rng, rng.randint(*output_len))
                out.append(TraceRequest(f"tenant{k}.chat{c}.{t}", tuple(history), tuple(reply),
                                        f"tenant{k}.chat{c}", salt))
                history += reply
    return out


def serving_mix(num_requests: int = 24, prompt_len: tuple[int, int] = (16, 160),
                output_len: tuple[int, int] = (8, 64), seed: int = 3, vocab: int = VOCAB) -> list[TraceRequest]:
    """Independent chat-like requests with spread prompt and output lengths (no shared prefix)."""
    rng = random.Random(seed)
    return [TraceRequest(f"mix{i}", tuple(rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_len))),
                         tuple(rng.randrange(4, vocab) for _ in range(rng.randint(*output_len))))
            for i in range(num_requests)]
