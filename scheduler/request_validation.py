"""Request validation: what a request or an imported snapshot must be before the engine takes it.

Every check raises ValueError (TypeError for a wrong type) naming the value and the limit, and
changes nothing. The limits are the model's (vocabulary, max_model_len), the engine's
(max_num_seqs) and the pools' (`check_fits`: a request that could never fit is refused here,
with the same max_tokens cap admission uses, so it never waits at the head of the queue).
"""
from __future__ import annotations

import numbers
from typing import Callable

from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot


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

    def check_snapshot(self, snap: RequestSnapshot) -> None:
        """What the engine knows of a snapshot (the manager checks its tensors): sampling state,
        tokens within the vocabulary and max_model_len, params valid for a new request here."""
        st = snap.sampling_state
        try:
            params = SamplingParams(**st["params"])
            priority = st["priority"]
            num_prompt = snap.num_prompt_tokens
            [int(k) for d in st["output_logprobs"] for k in d]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"snapshot {snap.req_id!r} has a malformed sampling state: {e!r}") from None
        if params.n != 1:
            raise ValueError(f"snapshot {snap.req_id!r} has n={params.n}; only n == 1 requests migrate")
        tokens = list(snap.token_ids)
        if isinstance(num_prompt, bool) or not isinstance(num_prompt, int) or not 1 <= num_prompt <= len(tokens):
            raise ValueError(f"snapshot {snap.req_id!r}: num_prompt_tokens={num_prompt!r} is not in "
                             f"[1, {len(tokens)}] (its token count)")
        self.validate(tokens, params, priority)
