"""Ollama's embedding routes: ``/api/embed`` (a batch, ``truncate``) and the older ``/api/embeddings``, over
the encoder the server holds (``server/embeddings_api.py`` does the work)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.embeddings_api import Dimensions, Texts, embedding_model, tokens_of, vectors_of
from kvserve.server.ollama.errors import ollama_errors
from kvserve.server.openapi_docs import ok
from kvserve.server.request_schema import NonEmptyStr, Strict

router = APIRouter(tags=["Embeddings"])


class EmbedRequest(Strict):
    model: str
    input: NonEmptyStr | Texts
    truncate: bool = True
    dimensions: Dimensions | None = Field(None, ge=1)
    keep_alive: str | float | None = None  # a chat model's (an embedding model stays loaded)
    options: dict | None = None  # sampling options mean nothing to an encoder


class LegacyEmbeddingsRequest(Strict):
    model: str
    prompt: NonEmptyStr
    keep_alive: str | float | None = None
    options: dict | None = None


class EmbedResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    embeddings: list[list[float]]


class LegacyEmbeddingResponse(BaseModel):
    embedding: list[float]


@router.post("/api/embed", response_model=None,
             responses=ok(EmbedResponse, "The inputs' embeddings, in order") | ollama_errors(
                 400, 404, 501, 503))
async def embed(body: EmbedRequest, request: Request) -> dict:
    start = time.perf_counter()
    async with embedding_model(request, body.model, body.keep_alive) as encoder:
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        tokens = await tokens_of(encoder, texts, body.truncate)
        vectors = await vectors_of(encoder, tokens, body.dimensions)
    return {"model": body.model, "embeddings": vectors.tolist(),
            "total_duration": int((time.perf_counter() - start) * 1e9), "load_duration": 0,
            "prompt_eval_count": sum(len(t) for t in tokens)}


@router.post("/api/embeddings", response_model=None,
             responses=ok(LegacyEmbeddingResponse, "The prompt's embedding") | ollama_errors(
                 400, 404, 501, 503))
async def legacy_embeddings(body: LegacyEmbeddingsRequest, request: Request) -> dict:
    async with embedding_model(request, body.model, body.keep_alive) as encoder:
        if not body.prompt:
            return {"embedding": []}  # what Ollama answers to an empty prompt
        vectors = await vectors_of(encoder, await tokens_of(encoder, [body.prompt]), None)
    return {"embedding": vectors[0].tolist()}
