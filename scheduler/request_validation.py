"""Request validation: what a request or an imported snapshot must be before the engine takes it.

Every check raises ValueError (TypeError for a wrong type) naming the value and the limit, and
changes nothing; a snapshot's checks raise SnapshotMismatchError (a ValueError) for all of it. The limits are the model's (vocabulary, max_model_len), the engine's
(max_num_seqs) and the pools' (`check_fits`: a request that could never fit is refused here,
with the same max_tokens cap admission uses, so it never waits at the head of the queue).
"""
from __future__ import annotations

import numbers
from typing import Callable

from hybridkv.errors import SnapshotMismatchError
from hybridkv.sampling_params import SamplingParams, check_priority
from hybridkv.snapshot import RequestSnapshot, check_fields, check_keys, is_int

# The sampling state an engine puts in a snapshot (scheduler/migration.py's freeze), key -> what it holds.
SAMPLING_STATE = {"prompt": "the prompt text or None", "params": "SamplingParams as a dict",
                  "priority": "a signed 64-bit int", "output_logprobs": "per output token {token id: "
                  "[logprob, rank, text]}", "num_cached_tokens": "prefix-hit tokens at its first admission"}


class RequestValidator:
    """vocab_size, max_model_len, max_num_seqs: the limits; check_fits(num_tokens, max_tokens):
    the manager's "can this ever fit" (raises RequestTooLargeError)."""

    def __init__(self, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 check_fits: Callable[[int, int], None]):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.check_fits = check_fits

    def validate(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError (TypeError for a wrong type) naming the value and the limit; nothing in
        the engine changes."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise TypeError(f"priority must be an integer (lower runs first), got {priority!r}")
        check_priority(priority)  # within 64 bits, as over HTTP
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise TypeError(f"prompt token id {bad[0]!r} is not an integer")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; this model's max_model_len is "
                             f"{self.max_model_len} (and one token must be left to generate)")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} sequences exceed this engine's max_num_seqs="
                             f"{self.max_num_seqs}; lower n or raise max_num_seqs")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab})")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary size {vocab}")
        self.check_fits(len(token_ids), self.max_new_tokens(len(token_ids), params))

    def max_new_tokens(self, num_tokens: int, params: SamplingParams) -> int:
        """Output tokens a request of `num_tokens` may generate: max_tokens, capped by max_model_len
        (the number both validation and admission check against the pools)."""
        return min(params.max_tokens, self.max_model_len - num_tokens)

    def check_snapshot(self, snap: RequestSnapshot) -> SamplingParams:
        """The whole schema of a snapshot the engine may import, before anything is allocated (the
        manager then checks its tensors against the model): every field's type and range
        (`snapshot.check_fields`), a string request id, a token left to compute
        (num_computed_tokens < tokens), fewer output tokens than max_tokens, the sampling state
        complete and typed (`SAMPLING_STATE`, params valid as SamplingParams, n == 1), and the
        tokens and params valid for a new request here. Returns its SamplingParams; raises
        SnapshotMismatchError naming what is wrong."""
        check_fields(snap)
        rid = snap.req_id
        if not isinstance(rid, str):
            raise SnapshotMismatchError(f"snapshot req_id {rid!r} must be a string (an engine's request id)")
        tokens, nc = list(snap.token_ids), snap.num_computed_tokens
        if nc >= len(tokens):
            raise SnapshotMismatchError(
                f"snapshot {rid!r}: num_computed_tokens={nc} leaves no token of its {len(tokens)} to "
                f"compute (an exported request always has one)")
        st = snap.sampling_state
        check_keys("sampling_state", st, SAMPLING_STATE)
        if not isinstance(st["params"], dict) or not all(isinstance(k, str) for k in st["params"]):
            raise SnapshotMismatchError(f"snapshot {rid!r}: sampling_state params must be a dict of "
                                        f"SamplingParams fields, got {st['params']!r:.200}")
        try:
            params = SamplingParams(**st["params"])
            check_priority(st["priority"])
        except (TypeError, ValueError) as e:
            raise SnapshotMismatchError(f"snapshot {rid!r}: sampling_state is malformed: {e}") from None
        if params.n != 1:
            raise SnapshotMismatchError(f"snapshot {rid!r} has n={params.n}; only n == 1 requests migrate")
        if st["prompt"] is not None and not isinstance(st["prompt"], str):
            raise SnapshotMismatchError(f"snapshot {rid!r}: sampling_state prompt must be a string or "
                                        f"None, got {st['prompt']!r:.80}")
        n_out = len(tokens) - snap.num_prompt_tokens
        if n_out >= params.max_tokens:
            raise SnapshotMismatchError(f"snapshot {rid!r} has {n_out} output tokens, max_tokens="
                                        f"{params.max_tokens}: it would have finished")
        cached = st["num_cached_tokens"]
        if not is_int(cached) or not 0 <= cached <= snap.num_prompt_tokens:
            raise SnapshotMismatchError(f"snapshot {rid!r}: sampling_state num_cached_tokens={cached!r} "
                                        f"is not an integer in [0, {snap.num_prompt_tokens}] (its prompt)")
        self._check_logprobs(rid, st["output_logprobs"], params, n_out)
        try:  # the prompt as a new request here (the same fit check), then the output so far
            self.validate(tokens[:snap.num_prompt_tokens], params, st["priority"])
        except (TypeError, ValueError) as e:
            raise SnapshotMismatchError(f"snapshot {rid!r} cannot run here: {e}") from None
        bad = [t for t in tokens[snap.num_prompt_tokens:] if t >= self.vocab_size]
        if bad:
            raise SnapshotMismatchError(f"snapshot {rid!r}: output token id {bad[0]} is outside the "
                                        f"vocabulary [0, {self.vocab_size})")
        if len(tokens) >= self.max_model_len:
            raise SnapshotMismatchError(f"snapshot {rid!r} has {len(tokens)} tokens; this model's "
                                        f"max_model_len is {self.max_model_len} (one must be left to generate)")
        return params

    def _check_logprobs(self, rid: str, lps, params: SamplingParams, n_out: int) -> None:
        """output_logprobs: one {token id: logprob | [logprob, rank, text]} per output token when
        params ask for logprobs (JSON made the ids strings and the Logprobs lists), else none."""
        want = n_out if params.logprobs is not None else 0
        if not isinstance(lps, list) or len(lps) != want:
            raise SnapshotMismatchError(f"snapshot {rid!r}: sampling_state output_logprobs must be a list "
                                        f"of {want} dicts (one per output token), got {lps!r:.120}")
        for d in lps:
            for k, v in d.items() if isinstance(d, dict) else [(None, d)]:
                tid = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k
                v = list(v) if isinstance(v, (list, tuple)) else [v]
                if (not is_int(tid) or not 0 <= tid < self.vocab_size or not 1 <= len(v) <= 3
                        or isinstance(v[0], bool) or not isinstance(v[0], (int, float))
                        or (len(v) > 1 and v[1] is not None and not is_int(v[1]))
                        or (len(v) > 2 and v[2] is not None and not isinstance(v[2], str))):
                    raise SnapshotMismatchError(
                        f"snapshot {rid!r}: sampling_state output_logprobs entry {k!r}: {v!r:.80} is not "
                        f"token id (< {self.vocab_size}) -> [logprob, rank or None, text or None]")
