"""The shapes OpenAI clients expect: error bodies, completion and chat responses, stream chunks,
logprobs. Plain functions from our outputs to JSON-ready dicts.
"""
from __future__ import annotations

import json
import time
from typing import Optional

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
    if tokenizer is None:
        return f"token_id:{token_id}"
    text = tokenizer.decode([token_id])
    # a special token decodes to nothing: its name keeps it apart from the others in a top-k dict
    return text or tokenizer.convert_ids_to_tokens(token_id) or f"token_id:{token_id}"


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                        offset: int = 0) -> dict:
    """The legacy completions `logprobs` object for these tokens; `offset` is the text already sent."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        s = token_str(tokenizer, tid)
        tokens.append(s)
        lps.append(entry.get(tid))
        tops.append({token_str(tokenizer, t): v for t, v in _top(entry, k)} if k else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(t: int, v: Optional[float]) -> dict:
        s = token_str(tokenizer, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, entry in zip(token_ids, logprobs):
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(t, v) for t, v in _top(entry, k)]})
    return {"content": content}
