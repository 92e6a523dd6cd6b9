"""How one prompt is sampled, in vLLM's shape; bad values fail here, naming the value and the limit."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows.
GREEDY_BELOW = 1e-5
# The most top log-probabilities one position may ask for (OpenAI's limit).
MAX_LOGPROBS = 20
# OpenAI's ranges for presence / frequency penalties and logit_bias values.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# top_k beyond any vocabulary (int32, as the top-k kernels index); -1 and 0 disable it.
MAX_TOP_K = 2**31 - 1
# A seed is 64 bits, signed or unsigned (what torch.Generator.manual_seed takes).
SEED_RANGE = (-(2**63), 2**64 - 1)
# A priority is a signed 64-bit int (lower runs first).
PRIORITY_RANGE = (-(2**63), 2**63 - 1)


def _int(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None, optional: bool = False):
    """`value` as an int (bools and floats refused: TypeError), within [lo, hi] (ValueError)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise ValueError(f"{name} must be an integer {bounds}, got {value}")
    return value


def check_priority(value) -> int:
    """A request's priority as an int within `PRIORITY_RANGE` (bools refused: TypeError)."""
    return _int("priority (lower runs first)", value, *PRIORITY_RANGE)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _real_in(name: str, value, lo: float, hi: float) -> float:
    value = _real(name, value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
    return value


def _logit_bias(value) -> dict[int, float]:
    """{token id: bias}; keys may be ints or digit strings (OpenAI sends strings)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {value!r:.80}")
    out = {}
    for key, bias in value.items():
        tid = key
        if isinstance(key, str):
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias key {key!r} is not a token id (an integer >= 0)")
            tid = int(key)
        out[_int("logit_bias token id", tid, lo=0)] = _real_in(f"logit_bias[{tid}]", bias,
                                                               -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return out


@dataclass
class SamplingParams:
    """Per-request sampling settings, checked for type and range when made.

    temperature 0 (or below 1e-5, `GREEDY_BELOW`) is greedy; NaN and inf are refused. top_k -1 or
    0 and top_p == 1 disable those filters (top_k at most `MAX_TOP_K`). `seed` (an int of 64 bits,
    signed or unsigned: `SEED_RANGE`) gives the request its own generator (reproducible whatever
    else is batched with it, and carried across migration). `n` samples
    share the prompt's KV blocks and start from copies of its state. `stop` strings end a
    sequence when they appear in its decoded text (not included); `stop_token_ids` (a list of
    ints) end it when sampled (included), as does EOS unless `ignore_eos`; `stop_reason` on the
    output says which string or id it was. `logprobs` = k (0 to 20, `MAX_LOGPROBS`) returns the
    sampled token's and the top-k log-probabilities of each sampled position (of the model's
    distribution, before any processor); `prompt_logprobs` = k the same for each prompt position
    (such a request gets no prefix-cache hit: every position is computed).

    Processors, in this order (as vLLM and transformers): `logit_bias` {token id: bias in
    [-100, 100]} is added to the logits; while fewer than `min_tokens` tokens are out, EOS and
    `stop_token_ids` are masked; `repetition_penalty` (> 0, 1 = off) divides positive / multiplies
    negative logits of every token in the prompt or output (transformers' rule);
    `frequency_penalty` and `presence_penalty` (in [-2, 2], OpenAI's) subtract count * f + (count
    > 0) * p for tokens in the output; then temperature, top_k, top_p, `min_p` (in [0, 1]: drop
    tokens whose probability is below min_p times the top one's). Penalties and bias apply to
    greedy requests too. Ints are ints: bools and floats are refused with a TypeError. The engine
    adds the limits of its model (`logprobs`, stop ids and logit_bias ids within the vocabulary,
    `n <= max_num_seqs`).

    `cache_pin_ttl_s` (seconds, not sampling: a cache hint) pins the turn: once the request ends,
    its prompt's and output's KV blocks and its final state stay findable for that long, taken
    by eviction only when nothing unpinned is left to take (a running request needs the memory).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    cache_pin_ttl_s: Optional[float] = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, lo=1)
        self.temperature = _real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k (-1 or 0 disables it)", self.top_k, lo=-1, hi=MAX_TOP_K)
        self.max_tokens = _int("max_tokens", self.max_tokens, lo=1)
        self.seed = _int("seed", self.seed, *SEED_RANGE, optional=True)  # 64 bits
        self.logprobs = _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS, optional=True)
        self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS,
                                    optional=True)
        self.presence_penalty = _real_in("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        self.frequency_penalty = _real_in("frequency_penalty", self.frequency_penalty, -MAX_PENALTY,
                                          MAX_PENALTY)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}")
        self.min_p = _real_in("min_p", self.min_p, 0.0, 1.0)
        self.min_tokens = _int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.cache_pin_ttl_s is not None:
            self.cache_pin_ttl_s = _real("cache_pin_ttl_s", self.cache_pin_ttl_s)
            if self.cache_pin_ttl_s <= 0:
                raise ValueError(f"cache_pin_ttl_s must be > 0 seconds (None: no pin), got {self.cache_pin_ttl_s}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r:.80}")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(stop)
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a list of token ids (ints), got {ids!r:.80}")
        self.stop_token_ids = [_int("stop_token_ids entry", t, lo=0) for t in ids]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty needs the sequence's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
