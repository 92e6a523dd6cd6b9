"""A conversation -> prompt token ids through the checkpoint's own chat template.

The template is applied straight to token ids (`tokenize=True`), so the BOS it writes is the only
one: formatting to a string and tokenizing that again would add a second. Used by `LLM.chat` and
by the server's /v1/chat/completions; each caller says in `instead` what to do when the
checkpoint cannot format a chat (the errors are ValueError / TypeError, raised before anything is
queued).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

Conversation = Sequence[Mapping[str, Any]]


def chat_prompt_ids(tokenizer, conversation: Conversation, *, where: str, instead: str,
                    chat_template: Optional[str] = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """One conversation ([{role, content}, ...]) -> token ids [L].

    `where` names the checkpoint in messages; `instead` is the advice when it has no tokenizer or
    no template (e.g. "pass token ids to generate()").
    """
    if tokenizer is None:
        raise ValueError(f"{where} has no tokenizer, so it cannot format a chat: {instead}")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}'s tokenizer has no chat template (no 'chat_template' in "
                         f"tokenizer_config.json, no chat_template.jinja): {instead}")
    if not isinstance(conversation, Sequence) or isinstance(conversation, (str, bytes)) or not all(
            isinstance(m, Mapping) for m in conversation):
        raise TypeError(f"a conversation must be a list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{conversation!r:.80}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True: "
                         "the first starts a new assistant turn, the second continues the last one")
    try:
        out = tokenizer.apply_chat_template([dict(m) for m in conversation], chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            tokenize=True, **(chat_template_kwargs or {}))
    except Exception as e:  # the template refused these messages (roles out of order, ...)
        raise ValueError(f"the chat template rejected the conversation {conversation!r:.120}: {e}") from None
    ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
