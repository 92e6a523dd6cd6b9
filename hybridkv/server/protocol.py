"""Request bodies of the OpenAI-compatible endpoints, and what they become: SamplingParams.

Fields beyond OpenAI's (as vLLM names them): `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `prompt_logprobs`, `ignore_eos`, `stop_token_ids`, `priority`, `cache_salt`,
`cache_pin` ({"ttl_s": seconds}: a pinned turn, SamplingParams.cache_pin_ttl_s; ours),
`return_token_ids` (each choice then carries its `token_ids`). `logit_bias` is OpenAI's
{"token id": bias}. A sampling field the request leaves out takes the checkpoint's
generation_config.json value when it has one (per field, as vLLM), else SamplingParams' default.
Types are strict, as in the Python API (request_body.py parses in pydantic's strict mode): a bool
is not a number, a float is not an int, a string is not a number; the values then go through
SamplingParams, whose checks are the Python API's. A field OpenAI has that the engine cannot
honour yet is refused with a 400 (`tools`, `response_format` other than text, ...), never
ignored; a field nobody knows is ignored with a logged warning (request_body.py).
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from hybridkv.models.generation_defaults import GenerationDefaults
from hybridkv.sampling_params import SamplingParams, check_priority

from .openai_format import APIError

# OpenAI fields that would change what the answer is, with the values that ask for nothing more.
_NOT_HONOURED = {"tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
                 "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
                 "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
                 "web_search_options": (None,)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class CachePin(BaseModel):
    """`cache_pin: {"ttl_s": 600}`: keep this turn's KV and final state findable for ttl_s seconds
    after it ends (SamplingParams.cache_pin_ttl_s)."""
    model_config = ConfigDict(extra="forbid", strict=True)

    ttl_s: float


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # extensions (vLLM's names)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_logprobs: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    priority: int = 0
    cache_salt: Optional[str] = None
    cache_pin: Optional[CachePin] = None
    return_token_ids: bool = False

    def refuse_unsupported(self) -> None:
        for name, fine in _NOT_HONOURED.items():
            value = (self.model_extra or {}).get(name)
            if value not in fine:
                raise APIError(f"{name}={value!r:.80} is not supported by this server (it serves plain text "
                               f"completions): leave {name} out", param=name)
        try:
            check_priority(self.priority)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param="priority") from None
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs is not supported with stream=true; ask without streaming",
                           param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")

    def max_tokens_given(self) -> bool:
        return "max_tokens" in self.model_fields_set

    def sampling_params(self, max_tokens: int, logprobs: Optional[int],
                        defaults: Optional[GenerationDefaults] = None) -> SamplingParams:
        """SamplingParams for this body, each field it leaves out taken from `defaults` (the
        checkpoint's generation_config.json) when set there; a bad value is a 400 that names it
        and its limit."""
        fields = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                      repetition_penalty=self.repetition_penalty, max_tokens=max_tokens)
        if defaults is not None:
            given = set(self.model_fields_set) - {"max_tokens"}
            fields = defaults.fill(fields, given | ({"max_tokens"} if self.max_tokens_given() else set()))
        try:
            return SamplingParams(n=self.n, **fields, seed=self.seed, stop=self.stop or [],
                                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
                                  presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens,
                                  logit_bias=self.logit_bias,
                                  cache_pin_ttl_s=self.cache_pin.ttl_s if self.cache_pin is not None else None)
        except (ValueError, TypeError) as e:  # SamplingParams' messages start with the field's name
            name = str(e).split(" ", 1)[0].split("[", 1)[0]
            name = "cache_pin" if name == "cache_pin_ttl_s" else name
            raise APIError(str(e), param=name if name in type(self).model_fields else None) from None


def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_error(where: str, value) -> APIError:
    return APIError(f"{where} is {value!r:.60} ({type(value).__name__}): a prompt is a string or a list of "
                    f"token ids (ints); give one, or a list of them", param="prompt")


class CompletionRequest(_Common):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by prompts()
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self, max_prompts: Optional[int] = None) -> list[Union[str, list[int]]]:
        """The prompt field as a list of prompts (a string or a token-id list each); a 400 naming
        the first element of another type, or when there are more than `max_prompts`."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list):
            raise _prompt_error("prompt", p)
        if not p:
            raise APIError("prompt is empty: give a string, a list of token ids, or a list of those",
                           param="prompt")
        if all(_is_token(x) for x in p):
            return [p]
        if max_prompts is not None and len(p) > max_prompts:
            raise APIError(f"prompt has {len(p)} prompts; this server takes at most {max_prompts} per request "
                           f"(hybridkv serve --max-prompts-per-request): split them over several requests",
                           param="prompt")
        for i, x in enumerate(p):
            if isinstance(x, list):
                bad = next((j for j, t in enumerate(x) if not _is_token(t)), None)
                if bad is not None:
                    raise _prompt_error(f"prompt[{i}][{bad}]", x[bad])
            elif not isinstance(x, str):
                raise _prompt_error(f"prompt[{i}]", x)
        return list(p)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError("echo=true is not supported by this server yet", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of={self.best_of} is not supported (only best_of == n)", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(f"logprobs must be between 0 and 20, got {self.logprobs}", param="logprobs")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self, i: int) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(f"messages[{i}].content has a part of type {part.type!r}; "
                               f"only text parts are supported", param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise APIError("messages is empty: give at least one message", param="messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise APIError(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}",
                               param="top_logprobs")

    def max_tokens_given(self) -> bool:
        return bool({"max_tokens", "max_completion_tokens"} & self.model_fields_set)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


def resolve_max_tokens(requested: Optional[int], prompt_len: int, max_model_len: int) -> int:
    """max_tokens for a prompt of `prompt_len`: the request's, or what the context leaves; 400 when
    the prompt and max_tokens together pass max_model_len."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(f"prompt has {prompt_len} tokens; this model's max_model_len is {max_model_len} "
                       f"(and one token must be left to generate): shorten the prompt", param="prompt")
    if requested is None:
        return room
    if isinstance(requested, int) and requested > room:
        raise APIError(f"prompt ({prompt_len} tokens) + max_tokens ({requested}) = {prompt_len + requested} "
                       f"exceeds this model's max_model_len of {max_model_len}; lower max_tokens to at most "
                       f"{room}", param="max_tokens")
    return requested
