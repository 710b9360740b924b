"""OpenAI's Responses API: ``POST /v1/responses`` (streamed as its typed events or not), ``GET`` and
``DELETE /v1/responses/{id}``.

The OpenAI Agents SDK's default model class and Codex-style agents speak it. A response's conversation is
kept in memory (the last ``STORED`` responses, unless ``store: false``) so that ``previous_response_id``
continues it: the stored turns, then the new input, through the model's chat template. Tools, tool choice
and ``text.format`` become the same grammar the chat APIs use (``tools.ToolUse``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.reasoning import ThoughtState
from kvserve.server.api_errors import APIError, engine_error, generation_error
from kvserve.server.model_slots import served
from kvserve.server.openai.responses_schemas import (
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    input_messages,
)
from kvserve.server.openapi_docs import documented, ok, openai_errors, typed_sse_stream
from kvserve.server.serving import EngineStream, collect_finals, sampling_params
from kvserve.server.streaming import SSE_PING, Tick, sse_response, sse_typed_event
from kvserve.server.thinking import Thinking, ThoughtStream, template_switch
from kvserve.server.tools import Calls, ToolCall, parse_calls, text_to_stream

router = APIRouter(tags=["OpenAI"])

STORED = 1000  # responses kept for previous_response_id and GET, least recently made dropped first


class ResponseStore:
    """Stored responses: the object as sent, and the conversation it ends (template messages)."""

    def __init__(self, capacity: int = STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict[str, Any]]]:
        if response_id not in self._items:
            raise APIError(404, f"no stored response with id '{response_id}' (kept in memory: the last "
                                f"{self.capacity}, and none from before a restart)", "previous_response_id")
        return self._items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


class Reply:
    """One response's objects and events."""

    def __init__(self, body: ResponsesRequest, model: str, tools_on: Calls | None,
                 thinking: Thinking | None = None) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.body = body
        self.model = model
        self.tools_on = tools_on
        self.thinking = thinking
        self.created = int(time.time())
        self.sequence = 0
        self.namespaces = body.namespaces()

    def thought(self, out: RequestOutput) -> str | None:
        return self.thinking.split(out.text)[0] if self.thinking is not None else None

    def split(self, out: RequestOutput) -> tuple[str, list[ToolCall]]:
        text = self.thinking.split(out.text)[1] if self.thinking is not None else out.text
        return parse_calls(text, self.tools_on) if self.tools_on else (text, [])

    def reasoning_item(self, thought: str, status: str = "completed") -> dict:
        content = [{"type": "reasoning_text", "text": thought}] if status == "completed" else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content,
                "status": status}

    def message_item(self, text: str, status: str = "completed") -> dict:
        parts = [{"type": "output_text", "text": text, "annotations": [],
                  "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": parts}

    def call_item(self, call: ToolCall) -> dict:
        """A ``function_call`` item; a namespaced tool's call names its namespace apart, as OpenAI's do."""
        namespace, _, name = call.name.rpartition(".")
        named = {"name": name,
                 "namespace": namespace} if namespace in self.namespaces else {"name": call.name}
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
                **named, "status": "completed", "arguments": json.dumps(call.arguments, ensure_ascii=False)}

    def output(self, out: RequestOutput) -> list[dict]:
        thought = self.thought(out)
        text, calls = self.split(out)
        items = [self.reasoning_item(thought)] if thought is not None else []
        if text or not calls:  # a message cut off by max_output_tokens is incomplete, as its response is
            items.append({**self.message_item(text), "status": "incomplete" if out.finish_reason == "length"
                          else "completed"})
        return items + [self.call_item(c) for c in calls]

    def response(self, out: RequestOutput | None, status: str | None = None) -> dict:
        b = self.body
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status or "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": b.instructions, "previous_response_id": b.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "tool_choice": b.tool_choice if isinstance(b.tool_choice,
                                                       str | None) else b.tool_choice.model_dump(),
            "parallel_tool_calls": bool(b.parallel_tool_calls), "temperature": b.temperature,
            "top_p": b.top_p, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "store": b.store is not False,
            "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)}
            if b.text and b.text.format else {"format": {"type": "text"}},
            "usage": None,
        }
        if out is None:
            return obj
        if out.finish_reason == "error":
            raise generation_error(out)
        cached = out.metrics.num_cached_tokens
        generated = out.metrics.num_generation_tokens
        length = out.finish_reason == "length"
        obj |= {
            "status": "incomplete" if length else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "output": self.output(out),
            "usage": {"input_tokens": len(out.prompt_token_ids),
                      "input_tokens_details": {"cached_tokens": cached}, "output_tokens": generated,
                      "output_tokens_details": {"reasoning_tokens": self.thought_tokens(out)},
                      "total_tokens": len(out.prompt_token_ids) + generated},
        }
        return obj

    def thought_tokens(self, out: RequestOutput) -> int:
        if self.thinking is None:
            return 0
        state = ThoughtState(self.thinking.reasoning)
        state.update(list(out.token_ids))
        return state.thought_tokens

    def event(self, kind: str, **data: Any) -> bytes:
        self.sequence += 1
        return sse_typed_event(kind, {"sequence_number": self.sequence - 1, **data})


@documented(router.post, "/v1/responses", ResponseObject,
            "The response; with stream: true, its events as server-sent events",
            typed_sse_stream(ResponseEvent), openai_errors(400, 404, 429, 503))
async def create_response(body: ResponsesRequest, request: Request):
    serving = await served(request, body.model)
    store = _store(request)
    try:
        messages = input_messages(body.input)
    except ValueError as e:
        raise APIError(400, str(e), "input") from None
    history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
    choice = body.tool_choice_spec()
    fmt = body.text.format if body.text else None
    use = serving.tool_use(body.function_tools(), choice, fmt.constraint if fmt else lambda: None,
                           "text.format")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    conversation = history + messages
    effort = body.reasoning.effort if body.reasoning else None
    enable = serving.thinking_switch(None if effort is None else effort != "none")
    prompt = await serving.encode_chat(system + conversation, tools=use.shown,
                                       template_variables=template_switch(enable, effort))
    thinking = serving.thinking(prompt, enable)
    params = sampling_params(
        None,
        max_tokens=body.max_output_tokens,
        temperature=serving.config.temperature_for(body.temperature, 1.0),
        top_p=1.0 if body.top_p is None else body.top_p,
        constraint=use.constraint,
        reasoning=thinking.reasoning if thinking is not None else None,
    )
    reply = Reply(body, body.model, use.calls, thinking)
    stream = await serving.start(prompt, params, reply.id, param="input")

    def keep(out: RequestOutput, response: dict) -> None:
        if body.store is not False and out.finish_reason != "error":
            text, calls = reply.split(out)
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = calls
            store.put(response, [*conversation, turn])

    hosted = body.hosted_tools()
    # a header is Latin-1: the names as JSON strings, escaped to ASCII
    left_out = ", ".join(json.dumps(name)[1:-1].replace('"', "'") for name in hosted)
    headers = (
        {"Warning": f'299 kvserve "hosted tools are not run here, left out: {left_out}"'} if hosted else None
    )
    if body.stream:
        response = sse_response(_events(stream, reply, keep, serving.config.heartbeat_seconds),
                                cleanup=stream.aclose)
        response.headers.update(headers or {})
        return response
    [final] = await collect_finals(request, [stream])
    response = reply.response(final)
    keep(final, response)
    return JSONResponse(response, headers=headers)


async def _events(stream: EngineStream, reply: Reply, keep, heartbeat: float) -> AsyncIterator[bytes]:
    """OpenAI's event sequence: created, in_progress (at once, SSE comments while the prompt is read), then
    per output item added / deltas / done, then completed (or incomplete). A thought streams as a reasoning
    item before the answer; with tools, an answer that starts with a call is held back and its items come
    whole at the end, as the chat endpoint does."""
    yield reply.event("response.created", response=reply.response(None))
    yield reply.event("response.in_progress", response=reply.response(None))
    thoughts = ThoughtStream(reply.thinking)
    streamed = _Streamed(reply)
    try:
        async with aclosing(stream.ticking(heartbeat)) as outputs:
            async for out in outputs:
                if isinstance(out, Tick):
                    yield SSE_PING
                    continue
                thought, answer = thoughts.feed(out)
                for event in streamed.thought_deltas(thought):
                    yield event
                for event in streamed.text_deltas(answer):
                    yield event
                if out.finished:
                    response = reply.response(out)
                    for event in streamed.finish(response):
                        yield event
                    keep(out, response)
                    kind = (
                        "response.completed" if response["status"] == "completed" else "response.incomplete"
                    )
                    yield reply.event(kind, response=response)
    except (APIError, EngineDeadError) as e:
        error = engine_error(e) or APIError(503, f"the engine failed: {e}", code="engine_dead")
        yield reply.event("error", code=error.code or str(error.status), message=error.message,
                          param=error.param)


class _Streamed:
    """What of a streamed response has gone out: the output indices of the reasoning item and the message
    (None until each opens), the thought so far (its done event repeats it whole), and whether the answer is
    still held back because it may be a call."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.holding = reply.tools_on is not None
        self.thought_index: int | None = None
        self.message_index: int | None = None
        self.thought_text = ""

    def thought_deltas(self, thought: str) -> list[bytes]:
        """A piece of thought; the first opens the reasoning item, which comes before the answer."""
        if not thought:
            return []
        reply = self.reply
        events = []
        if self.thought_index is None:
            self.thought_index = 0
            events.append(reply.event("response.output_item.added", output_index=0,
                                      item=reply.reasoning_item("", "in_progress")))
        self.thought_text += thought
        return [*events, reply.event("response.reasoning_text.delta", item_id=reply.reasoning_id,
                                     output_index=0, content_index=0, delta=thought)]

    def text_deltas(self, answer) -> list[bytes]:
        """A piece of the answer once it is text; the first closes the thought and opens the message."""
        reply = self.reply
        self.holding, text = text_to_stream(self.holding, answer, reply.tools_on)
        if not text:
            return []
        events = []
        if self.message_index is None:
            self.message_index = 0 if self.thought_index is None else 1
            events += _close_thought(reply, self.thought_index, self.thought_text)
            events += _open_message(reply, self.message_index)
        return [*events, reply.event("response.output_text.delta", item_id=reply.message_id,
                                     output_index=self.message_index, content_index=0, delta=text,
                                     logprobs=[])]

    def finish(self, response: dict) -> list[bytes]:
        """The finished response's items: a thought still open is closed, the message that streamed gets its
        done events, and the items that did not stream (held-back text, calls) come whole."""
        opened = self.message_index is not None  # the thought closed when the message opened
        events = [] if opened else _close_thought(self.reply, self.thought_index, self.thought_text)
        for index, item in enumerate(response["output"]):
            if index != self.thought_index:
                events += _item_events(self.reply, index, item, index == self.message_index)
        return events


def _close_thought(reply: Reply, index: int | None, thought: str) -> list[bytes]:
    if index is None:
        return []
    item = reply.reasoning_item(thought.strip())
    return [
        reply.event("response.reasoning_text.done", item_id=reply.reasoning_id, output_index=index,
                    content_index=0, text=thought.strip()),
        reply.event("response.output_item.done", output_index=index, item=item),
    ]


def _open_message(reply: Reply, index: int) -> list[bytes]:
    return [
        reply.event("response.output_item.added", output_index=index,
                    item=reply.message_item("", "in_progress")),
        reply.event("response.content_part.added", item_id=reply.message_id, output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
    ]


def _item_events(reply: Reply, index: int, item: dict, streamed: bool) -> list[bytes]:
    """The events of one finished output item; ``streamed``: a message whose text deltas went out."""
    events = []
    if item["type"] == "reasoning":  # a thought that was never streamed (none: it streams as it comes)
        return [reply.event("response.output_item.added", output_index=index, item=item),
                reply.event("response.output_item.done", output_index=index, item=item)]
    if item["type"] == "message":
        text = item["content"][0]["text"]
        if not streamed:
            events += _open_message(reply, index)
            if text:
                events.append(reply.event("response.output_text.delta", item_id=item["id"],
                                          output_index=index, content_index=0, delta=text, logprobs=[]))
        events += [
            reply.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, logprobs=[]),
            reply.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=item["content"][0]),
        ]
    else:
        events += [
            reply.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                 "status": "in_progress"}),
            reply.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"]),
            reply.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"]),
        ]
    return [*events, reply.event("response.output_item.done", output_index=index, item=item)]


@router.get("/v1/responses/{response_id}", response_model=None,
            responses=ok(ResponseObject, "A stored response") | openai_errors(404))
async def get_response(response_id: str, request: Request) -> dict:
    return _store(request).get(response_id)[0]


@router.delete("/v1/responses/{response_id}", response_model=None,
               responses=ok(dict, "The response is deleted") | openai_errors(404))
async def delete_response(response_id: str, request: Request) -> dict:
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
