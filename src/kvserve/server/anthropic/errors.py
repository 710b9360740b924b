"""Anthropic's error shape, ``{"type": "error", "error": {"type": ..., "message": ...}}``, on
``/v1/messages`` and below. Registered with ``api_errors`` when imported."""

from __future__ import annotations

from typing import Any

from kvserve.server.anthropic.bodies import AnthropicError
from kvserve.server.api_errors import APIError, ErrorShape, register_shape
from kvserve.server.openapi_docs import error_responses

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error_body(error: APIError) -> dict:
    kind = ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _owns(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


SHAPE = register_shape(ErrorShape("anthropic", _owns, anthropic_error_body, AnthropicError))


def anthropic_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented error responses of an Anthropic route."""
    return error_responses(SHAPE, statuses)
