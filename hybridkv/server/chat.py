"""Chat messages -> prompt token ids through the checkpoint's own chat template.

The template is applied straight to token ids (`tokenize=True`), so the BOS it writes is the only
one: formatting to a string and tokenizing that again would add a second.
"""
from __future__ import annotations

from typing import Any, Optional

from .openai_format import APIError


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """[{role, content}] -> token ids [L]; a 400 when the checkpoint cannot format a chat."""
    if tokenizer is None:
        raise APIError("this checkpoint has no tokenizer, so it cannot format a chat: use /v1/completions "
                       "with a list of token ids", param="messages")
    if not has_chat_template(tokenizer):
        raise APIError("this checkpoint's tokenizer has no chat template (no 'chat_template' in "
                       "tokenizer_config.json, no chat_template.jinja): use /v1/completions, or add a "
                       "template to the checkpoint", param="messages")
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True, **(template_kwargs or {}))
    except Exception as e:  # the template refused these messages (roles out of order, ...)
        raise APIError(f"the chat template rejected these messages: {e}", param="messages") from None
    ids = out["input_ids"] if hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
