"""Errors with real status codes, each in the shape of the API its path belongs to.

    OpenAI     {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}   (the default)
    Ollama     {"error": "..."}                                          (server/ollama/errors.py)
    Anthropic  {"type": "error", "error": {"type": ..., "message": ...}} 
    (server/anthropic/errors.py)

Each API package registers its ``ErrorShape`` (the paths it owns, an error's body, the status it sends,
the body's OpenAPI model) when imported; a path no package owns (kvserve's own routes, llama.cpp's, the
OpenAI ones) gets OpenAI's, defined here. Error responses are counted (``kvserve_request_errors_total``)
by ``middleware.ErrorCountMiddleware``, by the status sent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from kvserve.engine.async_engine import EngineDeadError, EngineShutdownError
from kvserve.engine.scheduler import QueueFullError
from kvserve.errors import PromptTooLongError

log = logging.getLogger(__name__)

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole_characters(text: str) -> str:
    """``text`` with lone surrogates (a client's "\\ud800", echoed in a message) as U+FFFD: a JSON
    body must encode as UTF-8."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


class APIError(Exception):
    """An error with a status code and a message that tells the client what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _whole_characters(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def generation_error(out) -> APIError:
    """The error of a request that finished with one: a 400 where its own grammar could not be followed,
    else a 500 (the engine's fault)."""
    if getattr(out, "error_status", 500) == 400:
        return APIError(400, out.error or "the request's grammar could not be followed",
                        code="grammar_failed")
    return APIError(500, f"generation failed: {out.error or 'unknown engine error'}")


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its engine requests were aborted."""




class OpenAIErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """Every error of a path no API package owns, and an SSE stream's last event when the engine fails
    mid-stream."""

    model_config = ConfigDict(extra="forbid")
    error: OpenAIErrorDetail


def openai_error_body(error: APIError) -> dict:
    kind = OPENAI_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def _same(status: int) -> int:
    return status


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How one API words an error. ``owns``: whether a path is its; ``body``: an error's JSON; ``status``:
    the status it sends for one (Ollama answers a full queue with 503, not 429); ``model``: the body's
    OpenAPI model; ``descriptions``: what each status means on its paths (openapi_docs' common ones where
    None)."""

    name: str
    owns: Callable[[str], bool]
    body: Callable[[APIError], dict]
    model: type
    status: Callable[[int], int] = _same
    descriptions: dict[int, str] | None = None


OPENAI_SHAPE = ErrorShape("openai", lambda path: True, openai_error_body, OpenAIError)
_SHAPES: list[ErrorShape] = []


def register_shape(shape: ErrorShape) -> ErrorShape:
    """An API package's shape, for the paths it owns (once per name: a module imported twice adds nothing)."""
    if all(s.name != shape.name for s in _SHAPES):
        _SHAPES.append(shape)
    return shape


def shape_for(path: str) -> ErrorShape:
    return next((s for s in _SHAPES if s.owns(path)), OPENAI_SHAPE)


def error_response(path: str, error: APIError) -> JSONResponse:
    headers = dict(error.headers or {})
    if error.status in (429, 503):
        headers.setdefault("Retry-After", "1")
    shape = shape_for(path)
    return JSONResponse(shape.body(error), status_code=shape.status(error.status), headers=headers)


def engine_error(e: Exception, param: str | None = None) -> APIError | None:
    """Maps what ``AsyncLLMEngine.generate`` raises at admission onto an ``APIError``; None for
    anything else (a bug: the caller re-raises it and the client gets a 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        return prompt_too_long(e.num_prompt_tokens, e.limit, param)
    if isinstance(e, QueueFullError):
        return APIError(429, f"the server is busy: {e}", code="queue_full")
    if isinstance(e, EngineShutdownError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(
            503, "the engine stopped after an internal error; restart the server", code="engine_dead"
        )
    if isinstance(e, ValueError):
        return APIError(400, str(e), param)
    return None


def prompt_too_long(num_tokens: int, limit: int, param: str | None = None) -> APIError:
    return APIError(
        400,
        f"the prompt is {num_tokens} tokens but the context limit is {limit} tokens "
        f"(the prompt and at least one new token must fit); shorten the prompt",
        param,
        "context_length_exceeded",
    )


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as one readable line; unknown fields say they are unsupported."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    kind = first.get("type")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ").removesuffix(".")
    union = _union_failure(errors)
    if union is not None:
        field, message = union
    elif kind == "extra_forbidden":
        message = f"unsupported parameter '{field}'; see docs/server-guide.md's table of supported parameters"
    elif kind == "json_invalid":
        field, message = None, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}"
    elif not loc and kind == "missing":
        message = "the request needs a JSON body"
    elif not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        message = "the request body must be a JSON object"
    else:
        message = f"{field}: {msg}" if field else msg
    return APIError(400, message, field)


def _is_union_member(part: object) -> bool:
    """pydantic names a union's member in an error's location by its type: ``str``, ``list[int]``
    (``constrained-str`` where the member has a constraint such as a minimum length)."""
    if not isinstance(part, str):
        return False
    part = part.removeprefix("constrained-")
    return "[" in part or part in ("str", "int", "float", "bool")


def _union_failure(errors: list[dict]) -> tuple[str, str] | None:
    """(field, message) when the first error is one of a union's members failing: pydantic reports each
    member's complaint, and the first (``prompt.str: Input should be a valid string``) misleads when the
    client meant another member. Says which types the field takes instead."""
    loc = [p for p in errors[0].get("loc", ()) if p != "body"]
    at = next((i for i, part in enumerate(loc) if _is_union_member(part)), None)
    if at is None:
        return None
    prefix = loc[:at]
    members: list[str] = []
    for error in errors:
        other = [p for p in error.get("loc", ()) if p != "body"]
        is_member = other[:at] == prefix and len(other) > at and _is_union_member(other[at])
        if is_member and other[at] not in members:
            members.append(other[at])
    names = [_type_name(m) for m in members]
    expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    field = ".".join(str(p) for p in prefix)
    return field, f"{field}: must be {expected}"


_TYPE_NAMES = {
    "str": ("a string", "strings"),
    "int": ("an integer", "integers"),
    "float": ("a number", "numbers"),
    "bool": ("a boolean", "booleans"),
}


def _type_name(tag: str, plural: bool = False) -> str:
    """``list[list[int]]`` -> "a list of lists of integers"."""
    tag = tag.replace("constrained-", "")
    if tag.startswith("list[") and tag.endswith("]"):
        items = _type_name(tag[5:-1], plural=True)
        return f"lists of {items}" if plural else f"a list of {items}"
    if tag.startswith("dict["):
        return "objects" if plural else "an object"
    one, many = _TYPE_NAMES.get(tag, (tag, tag))
    return many if plural else one


def install_error_handlers(app: FastAPI) -> None:
    def respond(request: Request, error: APIError) -> JSONResponse:
        return error_response(request.url.path, error)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        messages = {
            404: f"no such endpoint: {request.method} {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }
        message = messages.get(exc.status_code, str(exc.detail))
        # the router's 405 carries Allow (RFC 9110 requires it); keep whatever headers it set
        return respond(request, APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s %s: %r", request.method, request.url.path, exc)
        return respond(request, APIError(500, "internal server error; the server log has the details"))
