"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields) and their mapping to ``SamplingParams``.

Types are checked strictly (a string is not a number). Unknown fields are ignored, as vLLM ignores them; the few
whose meaning pagedllm lacks and that would change the answer (functions, best_of, suffix) are refused by name
unless null or their no-op value.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.response_format import StructuredOutputFields
from pagedllm.entrypoints.openai.tool_calls import ToolFields
from pagedllm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams, check_text

# Fields whose meaning pagedllm does not implement and that would change the answer if ignored: refused unless
# null or their no-op value. Any other unknown field is ignored with a debug log, as vLLM does (SDKs, agents and UIs
# send store, metadata, priority, reasoning_effort, ...).
_REFUSED_UNLESS: dict[str, list[Any]] = {
    "functions": [[]],
    "function_call": ["none"],
    "best_of": [1],
    "suffix": [""],
}
LOGIT_BIAS_LIMIT = 100.0
logger = logging.getLogger("pagedllm.server")


def check_text_fields(body: BaseModel) -> None:
    """A 400 naming the field for text that is not valid Unicode (a lone surrogate, which JSON can carry): the
    tokenizer and the engine's messages cannot take it."""
    for name, value in {**body.__dict__, **(body.model_extra or {})}.items():
        check_text(value.model_dump() if isinstance(value, BaseModel) else _dumped(value), name)


def _dumped(value):
    if isinstance(value, list):
        return [v.model_dump() if isinstance(v, BaseModel) else v for v in value]
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: the usage so far in every chunk


class _GenerationRequest(StructuredOutputFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None  # informational
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    priority: int = Field(0, ge=SEED_MIN, le=SEED_MAX)  # with --scheduling-policy priority: lower runs first
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def check_supported(self, endpoint: str) -> None:
        check_text_fields(self)
        extra = self.model_extra or {}
        unsupported = [name for name, value in extra.items()
                       if name in _REFUSED_UNLESS and value is not None and value not in _REFUSED_UNLESS[name]]
        if unsupported:
            raise OpenAIError(400, f"unsupported field(s) for {endpoint}: {', '.join(unsupported)}; pagedllm does "
                                   f"not implement them, remove them from the request", param=unsupported[0])
        ignored = sorted(set(extra) - set(_REFUSED_UNLESS))
        if ignored:
            logger.debug("%s: ignoring field(s) pagedllm does not use: %s", endpoint, ", ".join(ignored))
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options can only be given with stream=true", param="stream_options")

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage_in_stream and bool(self.stream_options.continuous_usage_stats)

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """Raises ``InvalidRequestError`` naming the field for a value out of range. ``prompt_logprobs`` defaults
        to the request's own field; ``defaults`` (the model's generation config) fill sampling fields left out."""
        defaults = defaults or {}

        def given(value, default):
            return default if value is None else value

        def sampling(name: str, neutral):
            return given(getattr(self, name), defaults.get(name, neutral))

        return SamplingParams(
            n=self.num_choices, temperature=sampling("temperature", 1.0), top_p=sampling("top_p", 1.0),
            top_k=sampling("top_k", 0), min_p=sampling("min_p", 0.0), seed=self.seed, max_tokens=max_tokens,
            min_tokens=given(self.min_tokens, 0), stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=given(self.include_stop_str_in_output, False),
            ignore_eos=given(self.ignore_eos, False), presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=sampling("repetition_penalty", 1.0), logit_bias=self._logit_bias(),
            logprobs=logprobs, prompt_logprobs=given(prompt_logprobs, self.prompt_logprobs),
            skip_special_tokens=given(self.skip_special_tokens, True),
            structured_outputs=structured_outputs, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise OpenAIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise OpenAIError(400, f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                                  param="logit_bias")
            bias[token_id] = value
        return bias


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None

    def check_supported(self, endpoint: str) -> None:
        super().check_supported(endpoint)
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens 0 generates nothing: it needs echo=true (to score the prompt)",
                              param="max_tokens")

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0 with echo: the answer is the prompt (and its logprobs), nothing generated."""
        return bool(self.echo) and self.max_tokens == 0


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message; extra keys (name, tool_call_id, ...) are handed to the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None


class ChatTemplateFields(BaseModel):
    """vLLM's fields that steer the chat template (chat completions and /tokenize with messages)."""

    model_config = ConfigDict(extra="allow", strict=True)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(_GenerationRequest, ChatTemplateFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)  # chat templates index messages[0]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens; wins when both are given
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check_supported(self, endpoint: str) -> None:
        super().check_supported(endpoint)
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1)
