"""All a sequence knows: its tokens, its params, its status. Memory lives in the cache manager."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from hybridkv.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted by recompute
    RUNNING = "running"      # holds blocks and a live slot
    SWAPPED = "swapped"      # preempted by swap: its KV and state wait in host memory
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence. A prompt with n > 1 becomes n sequences of one group after its prefill."""

    request_id: str
    group_id: str
    seq_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Optional[str] = None
    priority: int = 0            # lower runs first, as in vLLM
    cache_salt: Optional[str] = None
    arrival: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0   # prefix-hit tokens at first admission
    children_pending: int = 0    # n - 1 forks still to make when the prompt is done

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Who runs first: lower priority value, then earlier arrival."""
        return (self.priority, self.arrival)
