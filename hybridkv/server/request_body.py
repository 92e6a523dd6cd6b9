"""An HTTP request body -> a typed request (protocol.py), or an `APIError` in OpenAI's shape.

    limits = HTTPLimits(max_body_bytes=16 << 20, max_prompts=256)
    body = await read_body(request, CompletionRequest, limits)

The bytes are read up to `max_body_bytes` (a 413 past it), then parsed and validated in one
pass by pydantic's JSON parser in strict mode: invalid UTF-8, a lone UTF-16 surrogate escape
(`"\\ud800"`), nesting deeper than 200 levels, a bool where a number is due or a float where an
int is due are each a 400 naming where and what. Fields neither OpenAI nor hybridkv knows are
ignored with a logged warning (vLLM's rule); protocol.py refuses the OpenAI ones it cannot honour.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from .openai_format import APIError

log = logging.getLogger("hybridkv.server")

# Defaults of `hybridkv serve --max-body-mb` and `--max-prompts-per-request`.
DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt as JSON ids is about 1 MB
DEFAULT_MAX_PROMPTS = 256
_JSON_DEPTH = 200  # pydantic's parser (jiter) refuses deeper nesting itself

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class HTTPLimits:
    """What one HTTP request may carry: its body's bytes, and prompts in one /v1/completions call."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts: int = DEFAULT_MAX_PROMPTS

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HTTPLimits.{name} must be an integer >= 1, got {v!r}")


class BodyGone(Exception):
    """The client went away while its body was being read: nobody to answer."""


async def read_bytes(request: Request, limit: int) -> bytes:
    """The body's bytes; a 413 when it declares or sends more than `limit`. An oversized body is
    still drained, so the client reads the 413 instead of a reset connection."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                too_big = True
            if not too_big:
                chunks.append(chunk)
    except ClientDisconnect:
        raise BodyGone() from None
    if too_big:
        raise APIError(f"the request body has {max(size, int(declared or 0))} bytes; this server takes at "
                       f"most {limit} (hybridkv serve --max-body-mb): send fewer or shorter prompts",
                       status=413)
    return b"".join(chunks)


def _json_message(msg: str) -> str:
    """pydantic's JSON error as what the client should fix."""
    if "surrogate" in msg or "hex escape" in msg:
        return (f"the body has a lone UTF-16 surrogate escape (such as \"\\ud800\" without its pair), which "
                f"is not Unicode text ({msg}): send valid UTF-8 / paired escapes")
    if "unicode code point" in msg or "utf-8" in msg.lower():
        return f"the body is not valid UTF-8 ({msg})"
    if "recursion limit" in msg:
        return f"the body is nested deeper than {_JSON_DEPTH} levels ({msg})"
    return f"the body is not valid JSON: {msg}"


def _where(loc) -> str:
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "body"


def validation_error(exc: ValidationError) -> APIError:
    """pydantic's errors as one 400: per field, where, what was wrong and the value sent."""
    parts, param = [], None
    for err in exc.errors(include_url=False):
        if err["type"] == "json_invalid":
            return APIError(_json_message(str(err.get("ctx", {}).get("error", err["msg"]))))
        loc = [x for x in err["loc"] if x != "body"]
        if err["type"] == "model_type" and not loc:
            return APIError(f"the body must be a JSON object, got {err['input']!r:.80}")
        where = _where(loc)
        param = param or (str(loc[0]) if loc else None)
        value = err.get("input")
        shown = "" if err["type"] == "missing" else f" (got {value!r:.80})"
        if isinstance(value, bool) and err["type"] in ("int_type", "float_type"):
            shown += ": true and false are not numbers"
        parts.append(f"{where}: {err['msg']}{shown}")
    return APIError("; ".join(parts[:5]) or "invalid request body", param=param)


def parse_body(raw: bytes, model: type[M]) -> M:
    """`raw` as a `model` (strict JSON); a 400 naming what is wrong."""
    try:
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise validation_error(e) from None
    unknown = sorted(_unknown_fields(body))
    if unknown:
        log.warning("request fields ignored (not known to this server): %s", ", ".join(unknown)[:300])
    return body


def _unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    out = [prefix + k for k in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for i, v in enumerate(items):
            if isinstance(v, BaseModel):
                at = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                out += _unknown_fields(v, at)
    return out


async def read_body(request: Request, model: type[M], limits: HTTPLimits) -> M:
    """The request's body as a `model`: 413 past `limits.max_body_bytes`, 400 when malformed."""
    return parse_body(await read_bytes(request, limits.max_body_bytes), model)

