"""What the engine tells a request's caller: the data that crosses from the engine thread (or a
replica process) to the caller's side.

    TokenDelta   new tokens of one sequence from one step
    StepNews     what one step did for one request (its deltas, prompt facts, finished)
    DeltaOutput  what a caller's stream yields: one delta, detokenized
    EngineDeadError  the engine stopped; posted in place of news to every request it held
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TokenDelta:
    """New tokens of sequence `index` from one step (engine thread -> caller)."""

    index: int
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    final_text: Optional[str]  # the engine's whole text (stop string cut) once finished
    stop_reason: Optional[int | str] = None  # the stop string or id that ended it


@dataclass
class StepNews:
    """What one step did for one request."""

    deltas: list[TokenDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    prompt_logprobs: Optional[list] = None  # once, when the prompt is computed (if asked)


@dataclass
class DeltaOutput:
    """What `AsyncLLM.generate` yields: the new part of sequence `index` of a request."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_reason: Optional[int | str] = None
    prompt_logprobs: Optional[list] = None  # on the request's first delta, when asked


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an error in a step, or close()): no request can run."""
