"""When a sequence ends, and the text a user sees: EOS, stop ids, stop strings, max_tokens, length."""
from __future__ import annotations

from typing import Optional

from .request import Request


def decode(tokenizer, token_ids: list[int]) -> str:
    if tokenizer is None or not token_ids:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def check_stop(req: Request, eos_ids: set[int], max_model_len: int, tokenizer) -> Optional[str]:
    """The finish reason after the last appended token, or None to go on."""
    p, last = req.params, req.output_token_ids[-1]
    if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
        return "stop"
    if p.stop and tokenizer is not None:
        # Only the tail can hold a stop string the last token completed (earlier ones ended the
        # sequence at their own step); tokens decode to >= 1 character, plus a margin.
        tail = decode(tokenizer, req.output_token_ids[-(max(map(len, p.stop)) + 8):])
        if any(s in tail for s in p.stop):
            return "stop"
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
