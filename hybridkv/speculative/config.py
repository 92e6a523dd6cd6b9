"""`speculative_config`: which drafter proposes tokens and how many, in vLLM's shape
(`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Mapping, Optional, Union

METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: 'ngram' (prompt lookup: the proposal continues an earlier occurrence of the
    request's last n tokens; no model), 'draft_model' (`model`, a checkpoint with the target's
    vocabulary, proposes greedily; draft_model.py) or 'mtp' (the target checkpoint's own
    multi-token-prediction head, Qwen3-Next's `mtp.*`, chained to k tokens; mtp.py). num_speculative_tokens: the most tokens drafted per step
    for a request (its k; adaptive below that, scheduler/speculation.py). prompt_lookup_max /
    prompt_lookup_min: the longest and shortest n-gram matched. model: the draft checkpoint
    (method 'draft_model'). max_speculating_seqs (ours): how many running requests of a model
    with recurrent layers can verify a draft in the same step: the memory plan keeps
    (num_speculative_tokens + 1) state slots free for each (the state after each drafted position).
    off_when_slower (ours): measure tokens per second per batch size with drafts and without, and
    draft only where it is the faster (scheduler/speculation.py, StepCosts).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: Optional[str] = None
    max_speculating_seqs: int = 8
    off_when_slower: bool = True

    @classmethod
    def of(cls, value: Union[None, str, Mapping, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """None (speculation off), a SpeculativeConfig, a dict or its JSON text; unknown keys and
        bad values raise ValueError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config {value!r} is not JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict (or its JSON), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r}; choose one of {METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_speculating_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name}={v!r} must be an integer >= 1")
        if not isinstance(self.off_when_slower, bool):
            raise ValueError(f"speculative_config off_when_slower={self.off_when_slower!r} must be true or false")
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft checkpoint's path or name")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config 'model' is for method 'draft_model', not {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} is above "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
