"""Plain ASGI middleware: error counting, the API key check, the request body size limit and JSON bodies.

The API key and body checks answer in the error shape of the API the path belongs to (see ``errors``).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.host_memory import release_freed_memory
from kvserve.server.api_errors import APIError, error_response

OPEN_PATHS = frozenset({"/", "/health", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
OPEN_PREFIXES = ("/docs/assets/",)  # the API page's scripts and styles, served from the package
CLIENT_CLOSED = 499  # what the handlers "answer" a client that went away; it never reaches anyone


class ErrorCountMiddleware:
    """Calls ``record(status)`` for every error response, with the status actually sent, whoever sent
    it: a handler, the middleware inside this one (401, 413, a bad Content-Length), or Starlette's
    last-resort 500. Outermost of ours, so every other one is inside it."""

    def __init__(self, app: ASGIApp, record: Callable[[int], None]) -> None:
        self.app = app
        self.record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400 and message["status"] != CLIENT_CLOSED:
                    self.record(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # ServerErrorMiddleware, outside every middleware, answers it with a 500
                self.record(500)
            raise


class APIKeyMiddleware:
    """Every path but ``OPEN_PATHS`` needs ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or path in OPEN_PATHS
            or path.startswith(OPEN_PREFIXES)
            or scope["method"] == "OPTIONS"
        ):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if not secrets.compare_digest(given, self.api_key):
            error = APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},  # RFC 9110: a 401 names its auth scheme
            )
            return await error_response(scope["path"], error)(scope, receive, send)
        await self.app(scope, receive, send)


TRIM_AFTER_BYTES = 1 << 20  # a request body this large is followed by a heap trim


class BodyLimitMiddleware:
    """Refuses bodies over ``max_bytes`` with 413: at once when Content-Length says so, else as soon
    as the streamed (chunked) body crosses the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            error = None
            if not length.isdigit():
                error = APIError(400, f"invalid Content-Length header: {length.decode(errors='replace')!r}")
            elif int(length) > self.max_bytes:
                error = APIError(413, self._too_large(), code="body_too_large")
            if error is not None:
                return await error_response(scope["path"], error)(scope, receive, send)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # raised inside the endpoint's body read: FastAPI passes HTTPException through
                    raise HTTPException(413, self._too_large())
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            if received >= TRIM_AFTER_BYTES:
                # a big body leaves megabytes of freed C heap (its JSON, its text, its tokens) that glibc
                # keeps: hand them back, off the event loop (malloc_trim runs without the GIL)
                await asyncio.to_thread(release_freed_memory)


class JSONBodyMiddleware:
    """Every POST body here is JSON: read it as JSON whatever Content-Type says, as Ollama does
    (its documented ``curl -d '{...}'`` examples send application/x-www-form-urlencoded)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
