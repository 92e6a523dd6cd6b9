"""Chat messages -> prompt token ids for /v1/chat/completions: hybridkv.chat_template's rule, with
its errors as 400s that point at /v1/completions."""
from __future__ import annotations

from typing import Any, Optional

from hybridkv.chat_template import chat_prompt_ids as template_prompt_ids

from .openai_format import APIError


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """[{role, content}] -> token ids [L]; a 400 when the checkpoint cannot format a chat."""
    try:
        return template_prompt_ids(tokenizer, messages, where="this checkpoint",
                                   instead="use /v1/completions (with a list of token ids when there "
                                           "is no tokenizer), or add a template to the checkpoint",
                                   add_generation_prompt=add_generation_prompt,
                                   chat_template_kwargs=template_kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param="messages") from None
