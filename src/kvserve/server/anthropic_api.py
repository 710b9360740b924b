"""Anthropic-compatible endpoints: ``POST /v1/messages`` (streaming as Anthropic's events) and
``POST /v1/messages/count_tokens``, so Anthropic clients and coding agents work unchanged.

    event: message_start         {"type": "message_start", "message": {..., "content": [], "usage": {...}}}
    event: content_block_start   {"index": 0, "content_block": {"type": "text", "text": ""}}
    event: content_block_delta   {"index": 0, "delta": {"type": "text_delta", "text": "..."}}   ...
    event: content_block_stop    {"index": 0}
    event: message_delta         {"delta": {"stop_reason": "end_turn", ...}, "usage": {"output_tokens": n}}
    event: message_stop

A tool call is a ``tool_use`` block whose input arrives as one ``input_json_delta``. Usage follows
Anthropic's split: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those
served from the prefix cache.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.outputs import RequestOutput
from kvserve.server import anthropic_responses as responses
from kvserve.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from kvserve.server.errors import APIError, anthropic_error_body, engine_error
from kvserve.server.openapi_docs import anthropic_errors, anthropic_sse_stream, ok
from kvserve.server.serving import EngineStream, Serving, collect_finals, sampling_params
from kvserve.server.streaming import dumps, sse_response
from kvserve.server.tools import (
    Tool,
    ToolCall,
    ToolChoice,
    call_constraint,
    check_tools,
    parse_calls,
    text_to_stream,
)

router = APIRouter(tags=["Anthropic"])

PARAM_NAMES = {"stop": "stop_sequences"}


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n".encode()


async def _prompt(serving: Serving, body: CountTokensRequest) -> tuple[list[int], list[Tool], ToolChoice]:
    serving.check_model(body.model)
    try:
        tools, choice = body.tool_rules()
        check_tools(tools, choice)
        turns = body.template_messages()
    except ValueError as e:  # Anthropic's errors name no parameter
        raise APIError(400, str(e)) from None
    shown = tools if choice.mode != "none" else []
    return await serving.encode_chat(turns, tools=shown), shown, choice


@router.post(
    "/v1/messages",
    response_model=None,
    responses=ok(responses.MessageResponse, "The message; with stream: true, Anthropic's events", anthropic_sse_stream())
    | anthropic_errors(400, 404, 429, 503),
)
async def messages(body: MessagesRequest, request: Request):
    serving = _serving(request)
    prompt, tools, choice = await _prompt(serving, body)
    answer_format = body.output_config.constraint() if body.output_config else None
    params = sampling_params(
        PARAM_NAMES,
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
        constraint=call_constraint(tools, choice, answer_format),
    )
    message_id = f"msg_{uuid.uuid4().hex}"
    stream = await serving.start(prompt, params, message_id, param="messages")
    reply = MessageReply(message_id, body.model, bool(tools))
    if body.stream:
        return sse_response(_events(stream, reply), cleanup=stream.aclose)
    [final] = await collect_finals(request, [stream])
    return reply.message(final)


@router.post(
    "/v1/messages/count_tokens",
    response_model=None,
    responses=ok(responses.TokenCount, "The prompt's tokens, tools included") | anthropic_errors(400, 404),
)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    prompt, _, _ = await _prompt(_serving(request), body)
    return {"input_tokens": len(prompt)}


class MessageReply:
    """Builds one message's objects and events."""

    def __init__(self, message_id: str, model: str, tools_on: bool) -> None:
        self.id = message_id
        self.model = model
        self.tools_on = tools_on

    def content(self, out: RequestOutput) -> tuple[list[dict], list[ToolCall]]:
        text, calls = parse_calls(out.text) if self.tools_on else (out.text, [])
        blocks = [{"type": "text", "text": text}] if text or not calls else []
        return blocks + [_tool_use(c) for c in calls], calls

    def message(self, out: RequestOutput) -> dict:
        blocks, calls = self.content(out)
        reason, sequence = _stop(out, calls)
        return self._base(blocks, reason, sequence, out)

    def _base(self, blocks: list[dict], reason: str | None, sequence: str | None, out: RequestOutput) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(out),
        }

    def start(self, out: RequestOutput) -> bytes:
        return event("message_start", {"message": self._base([], None, None, out)})


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": call.name, "input": call.arguments}


def _stop(out: RequestOutput, calls: list[ToolCall]) -> tuple[str, str | None]:
    if out.finish_reason == "error":
        raise APIError(500, f"generation failed: {out.error or 'unknown engine error'}")
    if calls:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _usage(out: RequestOutput) -> dict:
    cached = out.metrics.num_cached_tokens
    return {
        "input_tokens": len(out.prompt_token_ids) - cached,
        "output_tokens": out.metrics.num_generation_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


async def _events(stream: EngineStream, reply: MessageReply) -> AsyncIterator[bytes]:
    """Text streams as text deltas; with tools, an answer that starts with a call (a call can only
    come first) is held back and its calls are sent as tool_use blocks when it ends."""
    started = text_open = False
    holding = reply.tools_on
    try:
        async with aclosing(stream.__aiter__()) as outputs:
            async for out in outputs:
                if not started:
                    started = True
                    yield reply.start(out)
                    yield event("ping", {})
                holding, text = text_to_stream(holding, out)
                if text:
                    if not text_open:
                        text_open = True
                        yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
                if out.finished:
                    for chunk in _ending(out, reply, holding, text_open):
                        yield chunk
    except (APIError, EngineDeadError) as e:
        error = engine_error(e) or APIError(503, f"the engine failed: {e}")
        yield event("error", {"error": anthropic_error_body(error)["error"]})


def _ending(out: RequestOutput, reply: MessageReply, holding: bool, text_open: bool) -> list[bytes]:
    blocks, calls = reply.content(out) if holding else ([], [])
    reason, sequence = _stop(out, calls)
    chunks = []
    if text_open:
        chunks.append(event("content_block_stop", {"index": 0}))
    for index, block in enumerate(blocks, start=int(text_open)):
        if block["type"] == "text":
            start, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start, delta = {**block, "input": {}}, {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        chunks += [
            event("content_block_start", {"index": index, "content_block": start}),
            event("content_block_delta", {"index": index, "delta": delta}),
            event("content_block_stop", {"index": index}),
        ]
    chunks.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"output_tokens": out.metrics.num_generation_tokens}}))
    chunks.append(event("message_stop", {}))
    return chunks
