"""The sampling defaults a checkpoint recommends in generation_config.json, as vLLM reads them."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from .checkpoint import CheckpointError, read_json

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json's sampling fields, by SamplingParams name; None = the file does not
    set it. vLLM's rule: a request field the user did not set takes the value here (the server per
    field; offline `generate(prompts)` with no SamplingParams takes them all). `do_sample` is
    ignored, as vLLM does. `eos_token_ids` are the file's `eos_token_id` (the model's EOS set,
    `model.eos_token_ids`, already includes them)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_tokens: Optional[int] = None  # the file's max_new_tokens
    eos_token_ids: tuple[int, ...] = ()

    def sampling_overrides(self) -> dict[str, float | int]:
        """The sampling fields the file sets, {SamplingParams field: value} (vLLM's
        `get_diff_sampling_param()`); empty when it sets none."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "eos_token_ids" and getattr(self, f.name) is not None}

    def fill(self, values: dict, given: set[str]) -> dict:
        """`values` (SamplingParams field -> value) with every field the file sets and the user did
        not (`given` names the ones the user did) taken from the file; max_tokens is the smaller
        of the value there (what the context leaves, or the API's default) and the file's, as
        vLLM's server. A new dict; the fields the file does not set are left as they are."""
        out = dict(values)
        for name, value in self.sampling_overrides().items():
            if name in given or name not in out:
                continue
            out[name] = min(out[name], value) if name == "max_tokens" and out[name] is not None else value
        return out


# generation_config.json key -> (SamplingParams field, its type, accepts the value, the range in words)
_FIELDS = {
    "temperature": ("temperature", float, lambda v: _real(v) and v >= 0, "a number >= 0 (0 is greedy)"),
    "top_p": ("top_p", float, lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", int, lambda v: _int(v) and v >= -1, "an integer >= -1 (<= 0 disables it)"),
    "min_p": ("min_p", float, lambda v: _real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": ("repetition_penalty", float, lambda v: _real(v) and v > 0, "a number > 0"),
    "max_new_tokens": ("max_tokens", int, lambda v: _int(v) and v >= 1, "an integer >= 1"),
}


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_generation_defaults(directory: Path) -> GenerationDefaults:
    """`directory`/generation_config.json -> GenerationDefaults (all None when the file is absent).

    Raises CheckpointError naming the file, the key and the value when the file is not a JSON
    object or a value is out of range.
    """
    file = Path(directory) / GENERATION_CONFIG
    if not file.is_file():
        return GenerationDefaults()
    g = read_json(file)
    values = {}
    for key, (name, kind, accepts, words) in _FIELDS.items():
        if g.get(key) is None:
            continue
        if not accepts(g[key]):
            raise CheckpointError(f"{file} has {key}={g[key]!r}; it must be {words}: fix or delete "
                                  f"the key")
        values[name] = kind(g[key])
    eos = g.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(_int(i) and i >= 0 for i in eos):
        raise CheckpointError(f"{file} has eos_token_id={g['eos_token_id']!r}; it must be a token id "
                              f"or a list of them (integers >= 0)")
    return GenerationDefaults(**values, eos_token_ids=tuple(eos))
