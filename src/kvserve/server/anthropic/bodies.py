"""Pydantic models of the Anthropic Messages responses and stream events we send, for the OpenAPI
document only (the handlers build plain dicts in ``anthropic/api``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Exact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextContent(Exact):
    type: Literal["text"]
    text: str


class ThinkingContent(Exact):
    type: Literal["thinking"]
    thinking: str  # a reasoning model's thought, whole
    signature: str  # empty: nothing is signed here


class ToolUseContent(Exact):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(Exact):
    input_tokens: int  # prompt tokens computed for this request
    output_tokens: int
    cache_read_input_tokens: int  # prompt tokens served from the prefix cache
    cache_creation_input_tokens: int


class MessageResponse(Exact):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(Exact):
    input_tokens: int


class AnthropicErrorDetail(Exact):
    type: str
    message: str


class AnthropicError(Exact):
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageStart(Exact):
    type: Literal["message_start"]
    message: MessageResponse


class ContentBlockStart(Exact):
    type: Literal["content_block_start"]
    index: int
    content_block: ThinkingContent | TextContent | ToolUseContent


class TextDelta(Exact):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(Exact):
    type: Literal["thinking_delta"]
    thinking: str


class InputJSONDelta(Exact):
    type: Literal["input_json_delta"]
    partial_json: str


class ContentBlockDelta(Exact):
    type: Literal["content_block_delta"]
    index: int
    delta: ThinkingDelta | TextDelta | InputJSONDelta


class ContentBlockStop(Exact):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(Exact):
    stop_reason: StopReason
    stop_sequence: str | None


class OutputUsage(Exact):
    """The message's whole usage (as Anthropic's ``message_delta`` now carries it): the prompt's split is
    final here, where ``message_start``'s was what was known when the request was admitted."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageDelta(Exact):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: OutputUsage


class MessageStop(Exact):
    type: Literal["message_stop"]


class Ping(Exact):
    type: Literal["ping"]


STREAM_EVENTS = (MessageStart, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta,
                 MessageStop, Ping, AnthropicError)
