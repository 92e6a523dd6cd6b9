"""A step's sampled tokens appended to their sequences, and the sequences that stop ended.

One tight loop over the sampled rows: append the token (the manager reads it from the sequence's
own list), keep its logprobs when asked, and ask `check_stop` only where the sequence's
`StopRule` says it may stop (a length limit reached, a stop or EOS id, stop strings to look for):
a token of a plain decode costs a list append, a length compare and a set lookup.
"""
from __future__ import annotations

from typing import Callable, Optional

from hybridkv.outputs import PositionLogprobs

from .sequence import Sequence, SequenceStatus
from .stopping import StopRule, check_stop, decoded_logprobs

_FINISHED = SequenceStatus.FINISHED


class TokenAppender:
    """Appends sampled tokens for a model (its EOS ids, max_model_len and tokenizer); `finish(seq,
    reason)` ends a sequence that stopped (the scheduler's)."""

    def __init__(self, eos_ids: set[int], max_model_len: int, tokenizer, finish: Callable[[Sequence, str], None]):
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.finish = finish

    def __call__(self, seqs: list[Sequence], tokens: list, logprobs: list[Optional[PositionLogprobs]],
                 fail: Callable[[Sequence, BaseException], None]) -> tuple[int, list[Sequence]]:
        """Append tokens[i] to seqs[i] (with logprobs[i] when not None); tokens[i] may be the
        exception its sampling raised. A row whose sequence finished meanwhile (a sibling failed)
        is skipped; one that raises goes to `fail` (which ends its request) and the loop goes on.
        Returns (tokens appended, the sequences that stopped and were finished)."""
        eos, max_len, tok_ = self.eos_ids, self.max_model_len, self.tokenizer
        appended, stopped = 0, []
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            if seq.status is _FINISHED:
                continue  # a sibling failed and took the group with it
            try:
                if tok.__class__ is not int:
                    raise tok
                ids = seq.token_ids
                ids.append(tok)
                appended += 1
                if lp is not None:
                    seq.output_logprobs.append(decoded_logprobs(tok_, lp))
                rule = seq.stop_rule
                if rule is None:
                    rule = seq.stop_rule = StopRule.of(seq, eos, max_len, tok_)
                if len(ids) >= rule.limit or tok in rule.ids or rule.strings:  # rule.may_stop, inlined
                    stop = check_stop(seq, eos, max_len, tok_)
                    if stop is not None:
                        seq.stop_reason = stop.stop_reason
                        self.finish(seq, stop.finish_reason)
                        stopped.append(seq)
            except Exception as e:
                fail(seq, e)
        return appended, stopped
