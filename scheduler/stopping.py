"""When a sequence ends, and the text a user sees: EOS, stop ids, stop strings, max_tokens, length."""
from __future__ import annotations

from typing import Optional

from .sequence import Sequence


def decode(tokenizer, token_ids: list[int]) -> str:
    if tokenizer is None or not token_ids:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def check_stop(seq: Sequence, eos_ids: set[int], max_model_len: int, tokenizer) -> Optional[str]:
    """The finish reason after the last appended token, or None to go on."""
    p, last = seq.params, seq.token_ids[-1]
    if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
        return "stop"
    if p.stop and tokenizer is not None:
        # Only the tail can hold a stop string the last token completed (earlier ones ended the
        # sequence at their own step); tokens decode to >= 1 character, plus a margin.
        keep = min(max(map(len, p.stop)) + 8, seq.num_output_tokens)
        tail = decode(tokenizer, seq.token_ids[-keep:])
        if any(s in tail for s in p.stop):
            return "stop"
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
