"""The shapes OpenAI clients expect: error bodies, completion and chat responses, stream chunks,
logprobs. Plain functions from our outputs to JSON-ready dicts.
"""
from __future__ import annotations

import json
import time
from typing import Optional

from hybridkv.outputs import Logprob, PositionLogprobs
from hybridkv.scheduler.stopping import token_text

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                503: "service_unavailable", 500: "internal_server_error"}


class APIError(Exception):
    """An error the client should see: status code, a message that names the value and the limit."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(kind: str, rid: str, model: str, choices: list, created: Optional[int] = None) -> dict:
    """kind: text_completion | chat.completion | chat.completion.chunk."""
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model,
            "choices": choices}


def token_str(tokenizer, token_id: int) -> str:
    """A token as text for logprobs; `token_id:N` when the checkpoint has no tokenizer (vLLM's form)."""
    return token_text(tokenizer, token_id)


def _top(entry: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely entries of a position, most likely first (by rank, as the engine gave)."""
    return sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))[:k]


def _text(tokenizer, token_id: int, lp: Optional[Logprob]) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return token_str(tokenizer, token_id)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[PositionLogprobs], k: int,
                        offset: int = 0) -> dict:
    """The legacy completions `logprobs` object for these tokens; `offset` is the text already sent."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        s = _text(tokenizer, tid, entry.get(tid))
        tokens.append(s)
        lps.append(entry[tid].logprob if tid in entry else None)
        tops.append({_text(tokenizer, t, v): v.logprob for t, v in _top(entry, k)} if k else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[PositionLogprobs], k: int) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(t: int, v: Optional[Logprob]) -> dict:
        s = _text(tokenizer, t, v)
        return {"token": s, "logprob": None if v is None else v.logprob, "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, entry in zip(token_ids, logprobs):
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(t, v) for t, v in _top(entry, k)]})
    return {"content": content}


def prompt_logprobs_json(entries: Optional[list[Optional[PositionLogprobs]]]) -> Optional[list]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {"token id": {logprob,
    rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": v.logprob, "rank": v.rank,
                                             "decoded_token": v.decoded_token} for t, v in e.items()}
            for e in entries]
