"""The OpenAPI document (``/openapi.json``) as the server really answers, so a client or a fuzzer can check
every response against it.

FastAPI documents what it can see: request bodies, and a 422 for validation errors that this server
never sends. The routes add what it cannot (``responses=``): each status code with the error body of
its API (``api_errors.OpenAIError``, Ollama's ``OllamaError``, ...), the 200 body's model,
and for streaming endpoints the stream's media type with an ``itemSchema`` for one SSE event or one
NDJSON line (OpenAPI 3.2's spelling, which FastAPI's own streaming routes use too).
``openapi_document`` then adds what every route shares: 401 where the API key applies, 413 and a bad
Content-Length for bodies, 500 everywhere, and the 422s removed.

This module knows no API dialect: each API's package hands its models to the helpers here, and the
models a stream names (which FastAPI does not collect, as no route returns them) are gathered as the
routes are declared (``streamed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from kvserve.server.api_errors import OPENAI_SHAPE, ErrorShape, OpenAIError, shape_for
from kvserve.server.request_schema import LIMIT, NEEDS, OTHERWISE, TOKEN_ID_KEY

JSON = "application/json"
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
SCHEMA_REF = "#/components/schemas/{model}"

ERROR_DESCRIPTIONS = {
    400: "Invalid request: a parameter, the JSON body, or the prompt (too long for the context)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    409: "The model is not loaded (a view of its pool never loads it)",
    413: "Request body over the server's limit",
    429: "Too many requests waiting: retry after Retry-After seconds",
    500: "Internal error; the server log has the details",
    501: "Not available on this server's setup (one engine's view, behind --replicas)",
    503: "The server is shutting down, its engine stopped after an internal error, or a model could not be "
    "loaded or fit in memory",
}
RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait", "schema": {"type": "string"}, "required": True}
}
WWW_AUTHENTICATE = {
    "WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}, "required": True}
}

# models referenced only from stream item schemas, which FastAPI does not collect itself: each added by
# ``streamed`` as a route that streams it is declared (at import)
_STREAMED_MODELS: dict[str, type] = {}


def ref(model: type) -> dict:
    return {"$ref": SCHEMA_REF.format(model=model.__name__)}


def streamed(model: type) -> dict:
    """``ref(model)`` for a model only a stream's items name: its schema then joins the document's."""
    _STREAMED_MODELS[model.__name__] = model
    return ref(model)


def sse_stream(chunk: type) -> dict:
    """``data: {chunk}`` events, then ``data: [DONE]``; an engine failure mid-stream sends
    ``data: {error}`` before ``[DONE]``."""
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {
            "contentMediaType": JSON,
            "contentSchema": {"anyOf": [streamed(chunk), streamed(OpenAIError)]},
        },
    }
    return {SSE: {"itemSchema": {"type": "object", "required": ["data"], "properties": {"data": data}}}}


def typed_sse_stream(*events: type) -> dict:
    """``event: <type>`` / ``data: {event}`` pairs, each event's data one of ``events`` (Anthropic's:
    message_start, content blocks, message_delta, message_stop, and ``error`` when the engine fails
    mid-stream; the Responses API's)."""
    data = {"contentMediaType": JSON, "contentSchema": {"anyOf": [streamed(m) for m in events]}}
    item = {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": {"type": "string", **data}}}
    return {SSE: {"itemSchema": item}}


def ndjson_stream(line: type, error: type) -> dict:
    """One JSON object a line, the last with ``done: true``, or an ``error`` line (Ollama's
    ``{"error": ...}``) when the engine fails mid-stream."""
    return {NDJSON: {"itemSchema": {"anyOf": [streamed(line), streamed(error)]}}}


def ok(model: type, description: str, stream: dict | None = None) -> dict[int | str, dict[str, Any]]:
    """The 200 response: ``model`` as JSON, and ``stream`` (``sse_stream``, ``ndjson_stream``) when the
    request asks for a stream."""
    response: dict[str, Any] = {"model": model, "description": description}
    if stream is not None:
        response["content"] = stream
    return {200: response}


def documented(route: Callable, path: str, model: type, description: str, stream: dict | None = None,
               errors: dict[int | str, dict[str, Any]] | None = None) -> Callable:
    """``route`` (``router.post``, ``router.get``) for ``path`` with its answers documented: ``model`` as the
    200 body (and ``stream``, ``sse_stream`` or ``ndjson_stream``, when the request asks for one) and
    ``errors``; the handler returns its response itself."""
    return route(path, response_model=None, responses=ok(model, description, stream) | (errors or {}))


def error_responses(shape: ErrorShape, statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """A route's documented errors in its API's shape (each package's helper: ``ollama_errors``, ...)."""
    descriptions = shape.descriptions or ERROR_DESCRIPTIONS
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        responses[status] = {"model": shape.model, "description": descriptions[status]}
        if status in (429, 503):
            responses[status]["headers"] = RETRY_AFTER
    return responses


def openai_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented errors of a route no API package owns (OpenAI's shape)."""
    return error_responses(OPENAI_SHAPE, statuses)


def openapi_document(app: FastAPI, open_paths: frozenset[str] | None, limits: dict[str, int] | None = None,
                     features: frozenset[str] = frozenset({"fim", "thinking"})) -> dict:
    """``app``'s OpenAPI document. ``open_paths``: the paths that need no API key, or None when the
    server has no key. What the served model decides is said too, so that every request the document
    allows is one the server takes: its ``limits`` ("token_id": the last id of its vocabulary, "n": the
    most choices a request may ask for), and what needs one of the model's
    ``features`` ("fim", "thinking") only when it has it: ``/infill``, ``suffix``, thinking switched on."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    if "fim" not in features:
        doc["paths"].pop("/infill", None)
    _as_served(doc, limits or {}, features)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    models = [(m, "serialization") for m in _STREAMED_MODELS.values()]
    _, extra = models_json_schema(models, ref_template=SCHEMA_REF)
    for name, schema in extra.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    if open_paths is not None:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
    for path, operations in doc["paths"].items():
        error = ref(shape_for(path).model)
        needs_key = open_paths is not None and path not in open_paths
        for operation in operations.values():
            _add_shared_responses(operation, error, needs_key)
    return doc


def _as_served(node: Any, limits: dict[str, int], features: frozenset[str]) -> None:
    """Fill in what ``request_schema`` marked for the running server: its limits, and fields that need a
    feature of its model."""
    if isinstance(node, dict):
        if NEEDS in node:
            feature, otherwise = node.pop(NEEDS), node.pop(OTHERWISE)
            if feature not in features:
                node.clear()
                node.update(otherwise)
        limit = limits.get(node.pop(LIMIT, None))
        if limit is not None:
            node["maximum"] = limit
        if node.pop(TOKEN_ID_KEY, False) and "token_id" in limits:
            node["pattern"] = f"^0*({below(limits['token_id'] + 1)})$"
        for value in node.values():
            _as_served(value, limits, features)
    elif isinstance(node, list):
        for value in node:
            _as_served(value, limits, features)


def below(n: int) -> str:
    """A regular expression for the decimal numbers 0 ... n - 1 (no leading zeros; n >= 1)."""
    digits = str(n)
    options = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        if d != "0":
            first = "1" if i == 0 and len(digits) > 1 else "0"
            if i == 0 and len(digits) > 1 and d == "1":
                continue  # no numbers of this length start below 1
            rest = f"[0-9]{{{len(digits) - i - 1}}}" if i < len(digits) - 1 else ""
            options.append(f"{digits[:i]}[{first}-{int(d) - 1}]{rest}")
    return "|".join(options)


def _add_shared_responses(operation: dict, error: dict, needs_key: bool) -> None:
    responses = operation["responses"]
    responses.pop("422", None)

    def add(status: int, **extra: Any) -> None:
        body = {"content": {JSON: {"schema": error}}, "description": ERROR_DESCRIPTIONS[status]}
        responses.setdefault(str(status), body | extra)

    if needs_key:
        operation["security"] = [{"bearer": []}, {"apiKeyHeader": []}]
        add(401, headers=WWW_AUTHENTICATE)
    if "requestBody" in operation:
        add(400)
        add(413)
    add(500)
