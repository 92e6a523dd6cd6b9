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


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


@dataclass
class SamplingParams:
    """Per-request sampling settings, checked for type and range when made.

    temperature 0 (or below 1e-5, `GREEDY_BELOW`) is greedy; NaN and inf are refused. top_k <= 0
    and top_p == 1 disable those filters. `seed` (an int) gives the request its own generator
    (reproducible whatever else is batched with it, and carried across migration). `n` samples
    share the prompt's KV blocks and start from copies of its state. `stop` strings end a
    sequence when they appear in its decoded text (not included); `stop_token_ids` (a list of
    ints) end it when sampled (included), as does EOS unless `ignore_eos`. `logprobs` = k (0 to
    20, `MAX_LOGPROBS`) returns the top-k log-probabilities of each sampled position. Ints are
    ints: bools and floats are refused with a TypeError. The engine adds the limits of its model
    (`logprobs` and stop ids within the vocabulary, `n <= max_num_seqs`).
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

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, lo=1)
        self.temperature = _real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k (<= 0 disables it)", self.top_k)
        self.max_tokens = _int("max_tokens", self.max_tokens, lo=1)
        self.seed = _int("seed", self.seed, optional=True)
        self.logprobs = _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS, optional=True)
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
