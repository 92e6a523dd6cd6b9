"""A step's sampled tokens appended to their sequences, and the sequences that stop ended.

`__call__`, any rows: one tight loop over the sampled rows: append the token (the manager reads it
from the sequence's own list), keep its logprobs when asked, and ask `check_stop` only where the
sequence's `StopRule` says it may stop (a length limit reached, a stop or EOS id, stop strings to
look for): a token of a plain decode costs a list append, a length compare and a set lookup.

`batch_stops` + `append_batch`, the engine's steady decode batch (the same running sequences for
many steps, every row greedy without logprobs): the rules are turned into arrays once per
batch (`BatchStops`), so a step finds the rows that may stop with a few numpy calls over all rows
and costs one list append per row; only those rows run through `check_stop`, in row order.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections import deque
from typing import Callable, Optional

import numpy as np

from hybridkv.outputs import PositionLogprobs
from hybridkv.request import Request, RequestStatus

from .stopping import StopRule, check_stop, decoded_logprobs

_FINISHED = RequestStatus.FINISHED


@dataclass(frozen=True)
class BatchStops:
    """The stop rules of one batch's rows (row order), as arrays a step tests in a few numpy calls.

    token_lists: each row's own `token_ids` list (appended to in place).
    ask_from: int64 [R], the length (prompt + output, after the append) from which the row's
        `check_stop` is asked whatever its token: its `StopRule.limit`, or 0 for a row with stop
        strings (asked every step).
    stop_table: bool [max id + 2] over token ids, True for the union of the rows' stop and EOS ids
        (`StopRule.ids`); its last entry is False, so `take(..., mode="clip")` answers False for
        any larger id. None when the union is empty (no row can stop on a token).
    """

    token_lists: list
    ask_from: np.ndarray
    stop_table: Optional[np.ndarray]

    def keep(self, rows: list[int]) -> "BatchStops":
        """The stops of the batch that keeps only these rows (ascending), e.g. once some stopped:
        no rule is read again (~4x cheaper than batch_stops at 256 rows). Its table still holds
        the dropped rows' ids: a few more rows asked, the same answers (check_stop decides)."""
        lists = self.token_lists
        return BatchStops([lists[i] for i in rows], self.ask_from[rows], self.stop_table)


class TokenAppender:
    """Appends sampled tokens for a model (its EOS ids, max_model_len and tokenizer); `finish(seq,
    reason)` ends a sequence that stopped (the scheduler's)."""

    def __init__(self, eos_ids: set[int], max_model_len: int, tokenizer, finish: Callable[[Request, str], None]):
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.finish = finish

    def __call__(self, seqs: list[Request], tokens: list, logprobs: list[Optional[PositionLogprobs]],
                 fail: Callable[[Request, BaseException], None]) -> tuple[int, list[Request]]:
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
                    self._end_if_stopped(seq, stopped)
            except Exception as e:
                fail(seq, e)
        return appended, stopped

    def _end_if_stopped(self, seq: Request, stopped: list[Request]) -> None:
        """Ask check_stop after seq's last token; a sequence that stops is finished and listed."""
        stop = check_stop(seq, self.eos_ids, self.max_model_len, self.tokenizer)
        if stop is not None:
            seq.stop_reason = stop.stop_reason
            self.finish(seq, stop.finish_reason)
            stopped.append(seq)

    def batch_stops(self, seqs: list[Request]) -> BatchStops:
        """The rows' stop rules as arrays, built once for a batch that keeps the same seqs (row
        order) for many steps; a row's `stop_rule` is made here when it has none yet."""
        eos, max_len, tok_ = self.eos_ids, self.max_model_len, self.tokenizer
        rules = []
        for seq in seqs:
            rule = seq.stop_rule
            if rule is None:
                rule = seq.stop_rule = StopRule.of(seq, eos, max_len, tok_)
            rules.append(rule)
        ask_from = np.array([0 if r.strings else r.limit for r in rules], dtype=np.int64)
        union = frozenset().union(*(r.ids for r in rules))
        table = None
        if union:  # a bool per id (one take per step) beats np.isin's sort for a few ids in 256k
            table = np.zeros(max(union) + 2, dtype=bool)
            table[list(union)] = True
        return BatchStops([seq.token_ids for seq in seqs], ask_from, table)

    def append_batch(self, seqs: list[Request], tokens: list[int], stops: BatchStops, lengths: np.ndarray,
                     fail: Callable[[Request, BaseException], None],
                     token_array: Optional[np.ndarray] = None) -> tuple[int, list[Request]]:
        """Append tokens[i] to seqs[i] for a steady decode batch; answers exactly what
        `self(seqs, tokens, [None] * R, fail)` would (tokens appended, sequences stopped and
        finished, in row order, with the same reasons and stop_reason; a row whose check raises
        goes to `fail` and the others go on).

        tokens: R sampled ids (ints: greedy, no logprobs kept: a row that wants logprobs does not
            belong here, its logprobs would be dropped); token_array: the same as int64 numpy [R]
            (the argmax tensor's `.numpy()` on the CPU), made from tokens when None and needed.
        stops: `batch_stops(seqs)` for these same seqs in this order.
        lengths: int64 numpy [R], each row's len(token_ids) AFTER this append.
        Precondition: every seq is running (none finished) at the call; `finish(seq, reason)` ends
        only `seq` (the scheduler's does). After a `fail`, which may end others (its group), the
        rest of the rows go through `__call__`, which skips the finished ones."""
        may = lengths >= stops.ask_from
        if stops.stop_table is not None:
            if token_array is None:
                token_array = np.array(tokens, dtype=np.int64)
            may |= stops.stop_table.take(token_array, mode="clip")
        asked = np.flatnonzero(may).tolist()
        lists = stops.token_lists
        if not asked:  # the usual step: the appends in one C loop
            deque(map(list.append, lists, tokens), maxlen=0)
            return len(tokens), []
        stopped, start = [], 0
        for i in asked:  # append up to row i, then ask row i (row order, as __call__)
            for ids, t in zip(lists[start:i + 1], tokens[start:i + 1]):
                ids.append(t)
            start = i + 1
            seq = seqs[i]
            try:
                self._end_if_stopped(seq, stopped)
            except Exception as e:
                fail(seq, e)
                appended, more = self(seqs[start:], tokens[start:], [None] * (len(seqs) - start), fail)
                return start + appended, stopped + more
        for ids, t in zip(lists[start:], tokens[start:]):
            ids.append(t)
        return len(tokens), stopped
