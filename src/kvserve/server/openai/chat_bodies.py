"""Pydantic models of the OpenAI response objects we send, for the OpenAPI document only.

The handlers build plain dicts (``chat_replies``); these models say what those dicts hold, field for
field, so a client or a fuzzer can check every response. Extra fields are forbidden here so that a field
added to a response and not to its model fails the schema tests instead of going undocumented.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class Exact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TopLogprob(Exact):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Exact):
    content: list[TokenLogprob]
    refusal: None


class CompletionLogprobs(Exact):
    """The legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class PromptTokensDetails(Exact):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(Exact):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Response(Exact):
    """What every response object and chunk shares."""

    id: str
    created: int
    model: str
    system_fingerprint: str


class FunctionCall(Exact):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(Exact):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Exact):
    role: Literal["assistant"]
    content: str | None  # None when the answer is only tool calls
    refusal: None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a reasoning model's thought, apart from the answer


class ChatChoice(Exact):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(ToolCall):
    index: int  # which call of the choice this is


class Delta(Exact):
    role: Literal["assistant"] | None = None  # only in each choice's first chunk
    content: str | None = None
    reasoning_content: str | None = None  # the thought as it comes, before the answer
    tool_calls: list[ToolCallDelta] | None = None  # each call whole, in the choice's last content chunk


class ChatChunkChoice(Exact):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class PromptProgress(Exact):
    """llama.cpp's ``prompt_progress`` (with ``return_progress``): ``processed`` counts the cached tokens."""

    total: int
    cache: int
    processed: int
    time_ms: float


class ChatCompletionChunk(Response):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    # present only with stream_options.include_usage: null on every chunk but the last
    usage: Usage | None = None
    # with return_progress, while the prompt is read (no choices)
    prompt_progress: PromptProgress | None = None


class CompletionChoice(Exact):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(CompletionChoice):
    finish_reason: FinishReason | None


class CompletionChunk(Response):
    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None  # as in ChatCompletionChunk
    prompt_progress: PromptProgress | None = None  # as in ChatCompletionChunk


class Model(Exact):
    """OpenAI's model object and Anthropic's in one (``GET /v1/models`` is both APIs' path): each SDK reads
    its own fields and skips the others'."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int  # vLLM's extra: the context one request may use
    type: Literal["model"]  # Anthropic's
    display_name: str  # Anthropic's
    created_at: str  # Anthropic's: RFC 3339


class ModelList(Exact):
    object: Literal["list"]
    data: list[Model]
    has_more: bool  # Anthropic's paging: every model is on the one page
    first_id: str | None
    last_id: str | None


