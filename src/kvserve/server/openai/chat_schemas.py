"""Pydantic models of the OpenAI requests we accept.

Unknown fields are refused (400, "unsupported parameter"). Fields OpenAI defines that we cannot
honour are accepted only with a value that asks for nothing (``functions: []``, ...); fields that do not
change the output (``user``, ``metadata``, ...) are accepted and ignored. docs/server-guide.md's table lists
every field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, WithJsonSchema, field_validator

from kvserve.engine.constraints import Constraint
from kvserve.server import request_schema
from kvserve.server.request_schema import NonEmptyStr, NonEmptyTokens, Strict
from kvserve.server.tools.definitions import (
    ToolCall,
    ToolChoice,
    ToolDefinition,
    echoed_arguments,
    format_constraint,
)

MAX_STOP = request_schema.MAX_STOP
SEED_RANGE = {"ge": -(2**63), "lt": 2**64}  # a negative seed is the same seed modulo 2**64

# field -> the values that ask for nothing (anything else is refused)
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"], []),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    "prompt_cache_options": (None,),
}


neutral_only = request_schema.neutral_only(NEUTRAL_VALUES)


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: chunks never carry an "obfuscation" field


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str
    # a JSON object as text, or what a model wrote instead (see tools.definitions.echoed_arguments)
    arguments: str


class ToolCallRecord(Strict):
    """An earlier assistant turn's call, as the client echoes it back."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class JSONSchemaFormat(Strict):
    name: str
    description: str | None = None
    schema_: request_schema.OptionalClientSchema = Field(None, alias="schema")
    strict: bool | None = None  # output always follows the schema here


class ResponseFormat(Strict):
    schema_rules = ({"if": {"properties": {"type": {"const": "json_schema"}}},
                     "then": {"required": ["json_schema"],
                              "properties": {"json_schema": {"type": "object"}}}},)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return format_constraint(self.type, self.json_schema.schema_ if self.json_schema else None)


# the content parts served: text (images and audio are refused by ChatMessage with a message naming them)
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


class ChatMessage(Strict):
    neutral_values: ClassVar = {"refusal": (None, ""), "function_call": (None,), "audio": (None,)}  # echoed
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "null"}, {"type": "array", "items": TEXT_PART}]})] = None
    name: str | None = None  # ignored
    tool_calls: list[ToolCallRecord] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    # what clients echo back from an earlier assistant message; only empty values are accepted
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None
    reasoning_content: str | None = None  # an earlier answer's thought, echoed back: not shown to the model

    @field_validator("content")
    @classmethod
    def text_parts_only(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
        return "\n".join(part["text"] for part in value)

    @field_validator("function_call", "audio", "refusal")
    @classmethod
    def empty_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"'{info.field_name}' in messages is not supported by this server")
        return value

    def for_template(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                ToolCall(c.function.name, echoed_arguments(c.function.arguments),
                         c.id) for c in self.tool_calls
            ]
        return message


class SamplingFields(Strict):
    """Fields shared by chat and legacy completions."""

    neutral_values = NEUTRAL_VALUES

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int | None, WithJsonSchema({"anyOf": [
        {"type": "integer", "minimum": 1, request_schema.LIMIT: "n"}, {"type": "null"}]})] = Field(None, ge=1)
    stop: NonEmptyStr | request_schema.StopList | None = Field(None)
    # published as +-2**62, inside what is taken: numbers near the bounds do not survive a trip through a
    # float
    seed: Annotated[int | None, WithJsonSchema({"anyOf": [
        {"type": "integer", "minimum": -(2**62), "maximum": 2**62}, {"type": "null"}]})] = Field(
            None, **SEED_RANGE)
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
    # llama.cpp's: streamed chunks with the prompt's progress while it is read
    return_progress: bool | None = None
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema({"anyOf": [{"type": "null"}, {
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$", request_schema.TOKEN_ID_KEY: True},
        # token id (as a string) -> added to its logit, -100..100
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}]})] = None
    # accepted and ignored: they do not change the output
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def bias_by_token_id(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

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
    schema_rules = (request_schema.STREAM_OPTIONS_NEED_STREAM, request_schema.top_logprobs_need_logprobs(0),
                    request_schema.tool_choice_needs_tools(request_schema.OPENAI_FORCING),
                    # one of them
                    {"not": {"required": ["max_tokens", "max_completion_tokens"], "properties": {
                        "max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}}})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    # a reasoning model's switch ("none": no thought); others ignore it, as llama.cpp does
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and llama.cpp's: variables for the template
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None

    check_chat_neutral = field_validator(
        "functions",
        "function_call",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "verbosity",
        "moderation",
        "prompt_cache_options",
    )(neutral_only)

    def thinking_switch(self) -> tuple[bool | None, dict[str, Any]]:
        """(thinking on or off, None: the template's default; the template's variables)."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = self.reasoning_effort
        enable = kwargs.get("enable_thinking", None if effort is None else effort != "none")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        if enable is not None:
            kwargs["enable_thinking"] = bool(enable)
        return (None if enable is None else bool(enable)), kwargs

    def tool_choice_spec(self) -> ToolChoice:
        choice = self.tool_choice or ("auto" if self.tools else "none")
        parallel = self.parallel_tool_calls is True  # asked for: see ToolChoice
        if isinstance(choice, NamedToolChoice):
            return ToolChoice("required", choice.function.name, parallel)
        return ToolChoice(choice, None, parallel)


class CompletionRequest(SamplingFields):
    schema_rules = (request_schema.STREAM_OPTIONS_NEED_STREAM, {
        # echo with logprobs would need the prompt's logprobs, not computed here
        "not": {"required": ["echo", "logprobs"],
                "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}}
    }, {
        # a suffix goes with text, not token ids
        "if": {"required": ["suffix"], "properties": {"suffix": {"type": "string"}}},
        "then": {"properties": {"prompt": {"anyOf": [{"type": "string"}, {
            "type": "array", "items": {"type": "string"}}]}}}})
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], WithJsonSchema(
        {"type": "array", "items": {"type": "string", "minLength": 1},
         "minItems": 1})] | NonEmptyTokens | Annotated[
        list[NonEmptyTokens], WithJsonSchema({"type": "array", "minItems": 1, "items": {
            "type": "array", "items": request_schema.TOKEN_ID_SCHEMA, "minItems": 1}})]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    # published as 1 only: best_of equal to n is taken too, which JSON Schema cannot say
    best_of: Annotated[int | None, WithJsonSchema({"enum": [None, 1]})] = Field(None, ge=1)
    # fill in the middle between prompt and suffix (a model with FIM tokens)
    suffix: Annotated[str | None,
                      request_schema.needs("fim", {"anyOf": [{"type": "string"}, {"type": "null"}]})] = None
