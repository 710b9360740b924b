"""How generated tokens reach the client: SSE and NDJSON framing, and cancellation on disconnect.

    SSE (OpenAI)     data: {"id": ..., "object": "chat.completion.chunk", ...}\\n\\n  ...  data: [DONE]\\n\\n
    NDJSON (Ollama)  {"model": ..., "response": "...", "done": false}\\n  ...  {"done": true, ...}\\n

A disconnected client must not keep its request running: streaming responses close their body
iterator (which aborts the engine request) however the response ends, and non-streaming handlers
run under ``cancel_on_disconnect``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from kvserve.server.api_errors import ClientDisconnected

T = TypeVar("T")
Cleanup = Callable[[], Awaitable[None]]

SSE_DONE = b"data: [DONE]\n\n"
SSE_PING = b": ping\n\n"  # an SSE comment: clients skip it, proxies and watchdogs see bytes flow


class Tick:
    """What ``with_ticks`` yields when its items are slow to come."""


TICK = Tick()


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: dict) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


def sse_typed_event(kind: str, data: dict) -> bytes:
    """An SSE event named by its type, as the Anthropic and Responses APIs send them."""
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n".encode()


def ndjson_line(obj: dict) -> bytes:
    return f"{dumps(obj)}\n".encode()


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator and then runs ``cleanup``: when the
    client goes away Starlette cancels the send loop, and an iterator left suspended at ``yield``
    would otherwise keep its engine requests alive until garbage collection. ``cleanup`` also
    covers a body iterator that never started (its own ``finally`` would never run)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        media_type: str,
        headers: dict | None = None,
        cleanup: Cleanup | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.cleanup = cleanup

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                if self.cleanup is not None:
                    await self.cleanup()


def sse_response(events: AsyncIterator[bytes], cleanup: Cleanup | None = None) -> EngineStreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return EngineStreamingResponse(events, "text/event-stream", headers, cleanup)


def ndjson_response(lines: AsyncIterator[bytes], cleanup: Cleanup | None = None) -> EngineStreamingResponse:
    return EngineStreamingResponse(lines, "application/x-ndjson", None, cleanup)


async def with_ticks(items: AsyncIterator[T], every: float) -> AsyncIterator[T | Tick]:
    """``items`` as they come, and ``TICK`` each time ``every`` seconds pass without one: a stream keeps
    speaking while a long prompt is read (agents drop a stream silent for minutes). Closing this closes
    ``items``; use it under ``contextlib.aclosing``."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait([pending], timeout=every)
            if not done:
                yield TICK
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait([pending])
        await items.aclose()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work``; if the client disconnects first, cancels it (aborting its engine requests) and
    raises ``ClientDisconnected``. For handlers that answer with one JSON object."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled itself
        await _cancel(task, watcher)
        raise
    if not task.done():
        await _cancel(task, watcher)
        raise ClientDisconnected()
    watcher.cancel()
    return task.result()


async def _cancel(*tasks: asyncio.Future) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
