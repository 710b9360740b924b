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
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import ClassVar

from fastapi import APIRouter, Request

from kvserve.engine.async_engine import EngineDeadError, PromptProgress
from kvserve.engine.constraints import Constraint
from kvserve.engine.outputs import RequestOutput
from kvserve.server.anthropic import bodies
from kvserve.server.anthropic.errors import anthropic_error_body, anthropic_errors
from kvserve.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from kvserve.server.api_errors import APIError, engine_error, generation_error
from kvserve.server.model_slots import served
from kvserve.server.openapi_docs import ok, typed_sse_stream
from kvserve.server.serving import EngineStream, Serving, collect_finals, sampling_params
from kvserve.server.streaming import Tick, sse_response, sse_typed_event
from kvserve.server.thinking import Thinking, ThoughtStream, template_switch
from kvserve.server.tools import Calls, ToolCall, ToolUse, parse_calls, text_to_stream

router = APIRouter(tags=["Anthropic"])
log = logging.getLogger(__name__)

PARAM_NAMES = {"stop": "stop_sequences"}




CLAUDE_PREFIX = "claude-"


def _model_name(request: Request, name: str) -> str | None:
    """The served model a request names; a Claude model's name that no served model has (Claude Code's
    subagents and its title and summary requests name ``claude-opus-*``, ``claude-haiku-*``, ...) goes to the
    default model, as llama.cpp's server answers any name, so an agent needs no setting to map them."""
    models = request.app.state.models
    if name.startswith(CLAUDE_PREFIX) and not any(slot.matches(name) for slot in models.slots):
        log.debug("model %r is not served: the default model answers it", name)
        return None
    return name


async def _prompt(
    serving: Serving, body: CountTokensRequest, answer: Callable[[], Constraint | None] = lambda: None
) -> tuple[list[int], ToolUse, Thinking | None]:
    """The prompt, what the request's tools mean for the answer (``answer``: the format of one that is not
    calls), and the thought; what cannot be used is a 400."""
    try:
        tools, choice = body.tool_rules()
        use = ToolUse.decide(tools, choice, answer, "output_config", serving.call_format, serving.written)
        turns = body.template_messages()
    except ValueError as e:  # Anthropic's errors name no parameter
        raise APIError(400, str(e)) from None
    asked = body.thinking.type if body.thinking else None
    if asked == "enabled" and not serving.tokenizer.thinks:
        raise APIError(400, f"'{body.model}' does not think; leave thinking out or disabled")
    enable = serving.thinking_switch({"enabled": True, "disabled": False}.get(asked or ""))
    if asked == "adaptive" and serving.tokenizer.thinks:
        enable = True
    prompt = await serving.encode_chat(turns, tools=use.shown, template_variables=template_switch(enable))
    budget = body.thinking.budget_tokens if body.thinking else None
    return prompt, use, serving.thinking(prompt, enable, budget)


@router.post(
    "/v1/messages",
    response_model=None,
    responses=ok(bodies.MessageResponse, "The message; with stream: true, Anthropic's events",
                 typed_sse_stream(*bodies.STREAM_EVENTS))
    | anthropic_errors(400, 404, 429, 503),
)
async def messages(body: MessagesRequest, request: Request):
    serving = await served(request, _model_name(request, body.model))
    answer = body.output_config.constraint if body.output_config else lambda: None
    prompt, use, thinking = await _prompt(serving, body, answer)
    params = sampling_params(
        PARAM_NAMES,
        max_tokens=body.max_tokens,
        temperature=serving.config.temperature_for(body.temperature, 1.0),
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
        constraint=use.constraint,
    )
    if thinking is not None:
        params = replace(params, reasoning=thinking.reasoning)
    message_id = f"msg_{uuid.uuid4().hex}"
    stream = await serving.start(prompt, params, message_id, param="messages")
    reply = MessageReply(message_id, body.model, use.calls, thinking)
    if body.stream:
        return sse_response(_events(stream, reply, serving.config.heartbeat_seconds), cleanup=stream.aclose)
    [final] = await collect_finals(request, [stream])
    return reply.message(final)


@router.post(
    "/v1/messages/count_tokens",
    response_model=None,
    responses=ok(bodies.TokenCount, "The prompt's tokens, tools included") | anthropic_errors(400, 404),
)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    prompt, *_ = await _prompt(await served(request, _model_name(request, body.model)), body)
    return {"input_tokens": len(prompt)}


class MessageReply:
    """Builds one message's objects and events."""

    def __init__(self, message_id: str, model: str, tools_on: Calls | None,
                 thinking: Thinking | None = None) -> None:
        self.id = message_id
        self.model = model
        self.tools_on = tools_on
        self.thinking = thinking

    def content(self, out: RequestOutput, with_thought: bool = True) -> tuple[list[dict], list[ToolCall]]:
        """(the blocks: a thinking block, text, tool_use; the calls)."""
        thought, text = self.thinking.split(out.text) if self.thinking is not None else (None, out.text)
        text, calls = parse_calls(text, self.tools_on) if self.tools_on else (text, [])
        blocks = [_thinking_block(thought)] if thought is not None and with_thought else []
        blocks += [{"type": "text", "text": text}] if text or not calls else []
        return blocks + [_tool_use(c) for c in calls], calls

    def message(self, out: RequestOutput) -> dict:
        blocks, calls = self.content(out)
        reason, sequence = _stop(out, calls)
        return self._base(blocks, reason, sequence, _usage(out))

    def _base(self, blocks: list[dict], reason: str | None, sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def start(self, progress: PromptProgress) -> bytes:
        """``message_start``, sent as soon as the request is admitted: its usage is what is known then (the
        prompt, and the cached part once the engine has looked it up); ``message_delta`` has the final one."""
        usage = {"input_tokens": progress.total - progress.cached, "output_tokens": 0,
                 "cache_read_input_tokens": progress.cached, "cache_creation_input_tokens": 0}
        return sse_typed_event("message_start", {"message": self._base([], None, None, usage)})


def _thinking_block(thought: str) -> dict:
    return {"type": "thinking", "thinking": thought, "signature": ""}  # nothing to sign: the thought is whole


def _tool_use(call: ToolCall) -> dict:
    """The call's id with Anthropic's prefix (``WrittenCalls`` finds it again when the client sends it
    back)."""
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
            "input": call.arguments}


def _stop(out: RequestOutput, calls: list[ToolCall]) -> tuple[str, str | None]:
    if out.finish_reason == "error":
        raise generation_error(out)
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


async def _events(stream: EngineStream, reply: MessageReply, heartbeat: float) -> AsyncIterator[bytes]:
    """``message_start`` at once, ``ping`` events while the prompt is read, then the answer: text streams as
    text deltas; with tools, an answer that starts with a call (a call can only come first) is held back and
    its calls are sent as tool_use blocks when it ends."""
    yield reply.start(stream.progress())
    holding = reply.tools_on is not None
    thoughts = ThoughtStream(reply.thinking)
    blocks = _Blocks()
    try:
        async with aclosing(stream.ticking(heartbeat)) as outputs:
            async for out in outputs:
                if isinstance(out, Tick):
                    yield sse_typed_event("ping", {})
                    continue
                thought, answer = thoughts.feed(out)
                if thought:
                    for chunk in blocks.delta("thinking", {"type": "thinking_delta", "thinking": thought}):
                        yield chunk
                holding, text = text_to_stream(holding, answer, reply.tools_on)
                if text:
                    for chunk in blocks.delta("text", {"type": "text_delta", "text": text}):
                        yield chunk
                if out.finished:
                    for chunk in _ending(out, reply, holding, blocks):
                        yield chunk
    except (APIError, EngineDeadError) as e:
        error = engine_error(e) or APIError(503, f"the engine failed: {e}")
        yield sse_typed_event("error", {"error": anthropic_error_body(error)["error"]})


class _Blocks:
    """The content blocks streamed so far: a delta of another kind closes the open block, opens its own."""

    STARTS: ClassVar[dict[str, dict]] = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                                         "text": {"type": "text", "text": ""}}

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None

    def delta(self, kind: str, delta: dict) -> list[bytes]:
        chunks = []
        if self.open != kind:
            chunks += self.close()
            self.open = kind
            chunks.append(sse_typed_event("content_block_start",
                                          {"index": self.count, "content_block": self.STARTS[kind]}))
        return [*chunks, sse_typed_event("content_block_delta", {"index": self.count, "delta": delta})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        chunk = sse_typed_event("content_block_stop", {"index": self.count})
        self.open = None
        self.count += 1
        return [chunk]


def _ending(out: RequestOutput, reply: MessageReply, holding: bool, streamed: _Blocks) -> list[bytes]:
    blocks, calls = reply.content(out, with_thought=False) if holding else ([], [])
    reason, sequence = _stop(out, calls)
    chunks = streamed.close()
    for index, block in enumerate(blocks, start=streamed.count):
        if block["type"] == "text":
            start, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start, delta = {**block, "input": {}}, {"type": "input_json_delta",
                                                    "partial_json": json.dumps(block["input"])}
        chunks += [
            sse_typed_event("content_block_start", {"index": index, "content_block": start}),
            sse_typed_event("content_block_delta", {"index": index, "delta": delta}),
            sse_typed_event("content_block_stop", {"index": index}),
        ]
    chunks.append(sse_typed_event("message_delta",
                                  {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                    "usage": _usage(out)}))
    chunks.append(sse_typed_event("message_stop", {}))
    return chunks
