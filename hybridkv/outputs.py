"""What generate() and step() hand back, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union


class Logprob(NamedTuple):
    """One token's log-probability, as vLLM's: `rank` 1 is the most likely token; `decoded_token`
    is the token's text (None when the checkpoint has no tokenizer)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: {token id: Logprob} holding the chosen token and the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (index j of n).

    `text` is decoded on first access (and cut before the first stop string), so a server that
    only reads token ids never pays for detokenization.
    """

    index: int
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" (EOS, stop id or string), "length", "abort", "error"
    logprobs: Optional[list[PositionLogprobs]] = None
    tokenizer: Any = field(default=None, repr=False, compare=False)
    stop: tuple[str, ...] = field(default=(), repr=False, compare=False)
    error: Optional[str] = None  # with finish_reason "error": what failed (the request alone ended)
    _text: Optional[str] = field(default=None, repr=False, compare=False)
    # the stop string or stop token id that ended it; None for EOS, length, abort (as vLLM)
    stop_reason: Union[int, str, None] = None

    @property
    def text(self) -> str:
        if self._text is None:
            text = ""
            if self.tokenizer is not None and self.token_ids:
                text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            cut = [text.find(s) for s in self.stop if s in text]
            self._text = text[: min(cut)] if cut else text
        return self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its n sequences so far; `finished` when all n are done."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one entry per prompt position, None for the first
    # (nothing predicts it); None when not asked (or, while the prompt is still computing)
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
