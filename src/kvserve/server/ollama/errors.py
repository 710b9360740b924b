"""Ollama's error shape: ``{"error": "..."}`` on every ``/api/...`` path, and 503 where OpenAI answers 429
(a full queue), as Ollama itself does. Registered with ``api_errors`` when imported."""

from __future__ import annotations

from typing import Any

from kvserve.server.api_errors import APIError, ErrorShape, register_shape
from kvserve.server.ollama.bodies import OllamaError
from kvserve.server.openapi_docs import ERROR_DESCRIPTIONS, error_responses

DESCRIPTIONS = ERROR_DESCRIPTIONS | {
    404: "Unknown model, or (/api/delete) one not installed",
    409: "The model is one this server serves",
    502: "pip could not install the model's packages (no network, no such release)",
    503: "Too many requests waiting (retry after Retry-After seconds), the server is shutting down, "
    "its engine stopped after an internal error, or a model could not be loaded or fit in memory",
}


def _body(error: APIError) -> dict:
    return {"error": error.message}


SHAPE = register_shape(ErrorShape("ollama", lambda path: path.startswith("/api/"), _body, OllamaError,
                                  lambda status: 503 if status == 429 else status, DESCRIPTIONS))


def ollama_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented error responses of an Ollama route."""
    return error_responses(SHAPE, statuses)
