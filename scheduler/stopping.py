"""When a sequence ends, and the text a user sees: EOS, stop ids, stop strings, max_tokens, length.

Before `min_tokens` output tokens nothing but length ends a sequence (the sampler also masks EOS
and stop ids until then), as vLLM. A `StopRule` per sequence tells after each token, with a length
compare and a set lookup, whether `check_stop` needs asking at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from hybridkv.outputs import PositionLogprobs
from hybridkv.request import Request



@dataclass(frozen=True)
class Stop:
    """Why a sequence ended: finish_reason "stop" or "length"; `stop_reason` the stop string or
    stop token id that did it (None for EOS and length, as vLLM)."""

    finish_reason: str
    stop_reason: Union[int, str, None] = None


def decode(tokenizer, token_ids: list[int]) -> str:
    if tokenizer is None or not token_ids:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def token_text(tokenizer, token_id: int) -> str:
    """One token as text (logprobs' decoded_token); `token_id:N` without a tokenizer (vLLM's form)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    text = tokenizer.decode([token_id])
    # a special token decodes to nothing: its name keeps it apart from the others in a top-k dict
    return text or tokenizer.convert_ids_to_tokens(token_id) or f"token_id:{token_id}"


def decoded_logprobs(tokenizer, entry: PositionLogprobs) -> PositionLogprobs:
    """entry with each Logprob's decoded_token set to its token's text (token_text)."""
    return {t: v._replace(decoded_token=token_text(tokenizer, t)) for t, v in entry.items()}


@dataclass(frozen=True, slots=True)
class StopRule:
    """What can end a sequence, as a cheap test run after every token: `check_stop` is asked only
    when `may_stop` holds (a length limit reached, a stop or EOS id, or stop strings to look for),
    so it answers the same as asking check_stop every time.

    limit: the length (prompt + output) at which max_tokens or max_model_len ends it.
    ids: stop token ids, plus EOS unless ignore_eos (min_tokens is check_stop's business).
    strings: whether it has stop strings and a tokenizer to find them with.
    """

    limit: int
    ids: frozenset
    strings: bool

    @classmethod
    def of(cls, seq: Request, eos_ids: set[int], max_model_len: int, tokenizer) -> "StopRule":
        p = seq.params
        ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(eos_ids))
        return cls(min(seq.num_prompt_tokens + p.max_tokens, max_model_len), ids,
                   bool(p.stop) and tokenizer is not None)

    def may_stop(self, num_tokens: int, last: int) -> bool:
        return num_tokens >= self.limit or last in self.ids or self.strings


def check_stop(seq: Request, eos_ids: set[int], max_model_len: int, tokenizer) -> Optional[Stop]:
    """Why the sequence ends after its last appended token, or None to go on."""
    p, last = seq.params, seq.token_ids[-1]
    num_output = len(seq.token_ids) - seq.num_prompt_tokens
    if num_output >= p.min_tokens:
        if last in p.stop_token_ids:
            return Stop("stop", last)
        if not p.ignore_eos and last in eos_ids:
            return Stop("stop")
        if p.stop and tokenizer is not None:
            # Only the tail can hold a stop string the last token completed (earlier ones ended the
            # sequence at their own step); tokens decode to >= 1 character, plus a margin.
            keep = min(max(map(len, p.stop)) + 8, num_output)
            tail = decode(tokenizer, seq.token_ids[-keep:])
            found = [(tail.find(s), i) for i, s in enumerate(p.stop) if s in tail]
            if found:  # the one the text is cut at: the earliest in the text
                return Stop("stop", p.stop[min(found)[1]])
    if num_output >= p.max_tokens or len(seq.token_ids) >= max_model_len:
        return Stop("length")
    return None
