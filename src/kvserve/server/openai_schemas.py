"""Pydantic models of the OpenAI requests we accept.

Unknown fields are refused (400, "unsupported parameter"). Fields OpenAI defines that we cannot
honour are accepted only with a value that asks for nothing (``tools: []``, ``response_format:
{"type": "text"}``, ...); fields that do not change the output (``user``, ``metadata``, ...) are
accepted and ignored. The README's table lists every field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from kvserve.server import strict_schema
from kvserve.server.strict_schema import Strict

MAX_STOP = 16
SEED_RANGE = {"ge": -(2**63), "lt": 2**64}  # what torch.Generator.manual_seed takes

# field -> the values that ask for nothing (anything else is refused)
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    "prompt_cache_options": (None,),
    "suffix": (None, ""),
}


neutral_only = strict_schema.neutral_only(NEUTRAL_VALUES)


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: chunks never carry an "obfuscation" field


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # ignored
    # what clients echo back from an earlier assistant message; only empty values are accepted
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None

    @field_validator("content")
    @classmethod
    def text_parts_only(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
        return "\n".join(part["text"] for part in value)

    @field_validator("tool_calls", "function_call", "audio", "refusal")
    @classmethod
    def empty_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"'{info.field_name}' in messages is not supported by this server")
        return value

    def for_template(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content or ""}


class SamplingFields(Strict):
    """Fields shared by chat and legacy completions."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None)
    seed: int | None = Field(None, **SEED_RANGE)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # extras (vLLM spellings)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    # accepted, refused unless neutral
    logit_bias: dict[str, float] | None = None
    # accepted and ignored: they do not change the output
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    check_neutral = field_validator("logit_bias")(neutral_only)

    @field_validator("stop")
    @classmethod
    def stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None  # ignored: there are no tools
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None

    check_chat_neutral = field_validator(
        "response_format",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "verbosity",
        "moderation",
        "prompt_cache_options",
    )(neutral_only)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    check_completion_neutral = field_validator("suffix")(neutral_only)
