"""What generate() and step() hand back, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (index j of n)."""

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: Optional[str] = None  # "stop" (EOS, stop id or string), "length", "abort"
    logprobs: Optional[list[dict[int, float]]] = None

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
