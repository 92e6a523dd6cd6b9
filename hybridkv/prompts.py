"""Prompts as `LLM` takes them, and their token ids.

A prompt is text (encoded by the checkpoint's tokenizer), token ids (a list or tuple of ints, or a
1-D numpy / torch integer array), or a vLLM-style dict: {"prompt": text} or {"prompt_token_ids":
ids} (with "prompt" beside the ids as the text they came from), optionally with "cache_salt".
Anything else is refused with ValueError / TypeError naming the value, before any of it is queued.
"""
from __future__ import annotations

import numbers
from typing import Mapping, Optional, Sequence, Union

Prompt = Union[str, Sequence[int], Mapping[str, object]]
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")  # vLLM's; refused


def parse_prompt(prompt: Prompt, tokenizer) -> tuple[list[int], Optional[str], Optional[str]]:
    """(token ids, prompt text or None, the prompt's own cache_salt or None). tokenizer: the
    checkpoint's (None: text is refused). Raises ValueError / TypeError for a prompt of another
    shape."""
    salt = None
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - set(PROMPT_KEYS) - set(MULTIMODAL_KEYS))
        if unknown:
            raise ValueError(f"prompt dict has unknown key(s) {unknown}; accepted keys: {list(PROMPT_KEYS)}")
        mm = [k for k in MULTIMODAL_KEYS if k in prompt]
        if mm:
            raise ValueError(f"prompt dict key(s) {mm}: multi-modal input is not supported; give text "
                             "or token ids")
        if "prompt_token_ids" not in prompt and "prompt" not in prompt:
            raise ValueError(f"prompt dict {dict(prompt)!r} has neither 'prompt' (text) nor "
                             "'prompt_token_ids' (a list of ints); give one of them")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"prompt dict 'cache_salt' must be a string, got {type(salt).__name__}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt dict 'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return as_token_ids(prompt["prompt_token_ids"], "'prompt_token_ids'"), text, salt
        return encode(tokenizer, text), text, salt
    if isinstance(prompt, str):
        return encode(tokenizer, prompt), prompt, None
    return as_token_ids(prompt, "a prompt"), None, None


def encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
    return list(tokenizer(text)["input_ids"])


def as_token_ids(ids, what: str) -> list[int]:
    """A list of ints from a list / tuple of ints or a 1-D numpy or torch integer array;
    floats, bools, bytes and strings (of digits too) are refused, naming the value."""
    if isinstance(ids, (str, bytes, bytearray, Mapping)):
        raise TypeError(f"{what} must be a list of token ids, got {type(ids).__name__}")
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) != 1:
        raise TypeError(f"{what} must be a 1-D array of token ids, got shape {tuple(ids.shape)}")
    try:
        seq = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [t for t in seq if isinstance(t, bool) or not isinstance(t, numbers.Integral)][:1]
    except TypeError:
        seq, bad = None, [ids]
    if bad:
        bad = bad[0]
        raise TypeError(f"{what} must be text, a list of integer token ids or a prompt dict; got "
                        f"{ids!r:.80} (token id {bad!r} is not an integer)")
    return [int(t) for t in seq]


def is_one_prompt(prompts) -> bool:
    """Whether `prompts` is one prompt (text, a dict, token ids) rather than a list of them."""
    if isinstance(prompts, (str, Mapping)):
        return True
    if hasattr(prompts, "tolist") and hasattr(prompts, "ndim"):  # numpy / torch
        return prompts.ndim == 1
    return (isinstance(prompts, (list, tuple)) and len(prompts) > 0
            and isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool))
