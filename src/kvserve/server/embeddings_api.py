"""Sentence embeddings beside the chat models: OpenAI's ``/v1/embeddings`` here, and what Ollama's routes
(``ollama/embed_api.py``) share with it, from the encoder ``kvserve serve --embedding-model NAME`` (or an
encoder among its models) loads (``models.encoder``; ``all-minilm`` in the registry).

A BERT encoder runs in a worker thread (torch computes without the GIL), a batch of inputs at a time,
never on the event loop; a decoder (an embedding GGUF, or a chat model) sends its inputs through its
engine's steps (``embedding.decoder_encoder``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from kvserve.embedding.decoder_encoder import DecoderEncoder
from kvserve.lazy_torch import torch
from kvserve.models.encoder import Encoder, length_batches
from kvserve.server.api_errors import APIError, engine_error
from kvserve.server.openapi_docs import ok, openai_errors
from kvserve.server.request_schema import LIMIT, TOKEN_ID_SCHEMA, NonEmptyStr, NonEmptyTokens, Strict

router = APIRouter(tags=["Embeddings"])

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
# the inputs of one request as the published schema says them: 1 to MAX_INPUTS, none empty (the handlers
# refuse others with their own messages)
Texts = Annotated[list[str], WithJsonSchema({"type": "array", "items": {"type": "string", "minLength": 1},
                                             "minItems": 1, "maxItems": MAX_INPUTS})]
# 1 ... the model's dimensions: the published maximum is the largest embedding model's at start (LIMIT)
Dimensions = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 1, LIMIT: "dimensions"})]
TokenLists = Annotated[list[list[int]],
                       WithJsonSchema({"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
                                                        "items": {"type": "array", "items": TOKEN_ID_SCHEMA,
                                                                  "minItems": 1}})]
BATCH = 32  # inputs the encoder reads at once


class EmbeddingsRequest(Strict):
    model: str
    input: NonEmptyStr | Texts | NonEmptyTokens | TokenLists
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = Field(None, ge=1)
    user: str | None = None  # ignored


class EmbeddingsResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    object: Literal["list"]
    data: list[dict]
    model: str
    usage: dict


def names(encoder: Encoder | None, model: str) -> bool:
    """Whether ``model`` is the encoder's name (or Ollama's ``name:latest`` of it)."""
    return encoder is not None and model in (encoder.name, f"{encoder.name}:latest")


@contextlib.asynccontextmanager
async def embedding_model(request: Request, model: str,
                          keep_alive: str | float | None = None) -> AsyncIterator[Encoder]:
    """The embedding model ``model`` names, or a chat model's own embeddings (the mean of its final hidden
    states, through its engine, loading it if need be: Ollama and llama.cpp's server embed with any model),
    kept loaded while the block runs (its inputs go in waves, no stream open between them)."""
    models = request.app.state.models
    if not names(request.app.state.encoder, model) and any(slot.matches(model) for slot in models.slots):
        async with models.lease(model, keep_alive) as serving:
            if getattr(serving.async_engine, "serves_replicas", False):
                raise APIError(501,
                               "a chat model embeds through its own engine: not behind --replicas (serve an "
                                    "embedding model with --embedding-model)", "model", "not_available")
            yield DecoderEncoder.of_chat_model(serving.async_engine, serving.card.name)
        return
    yield served_encoder(request, model, "encoder", "embeds", "--embedding-model all-minilm")


def served_encoder(request: Request, model: str, role: str, verb: str, flag: str) -> Encoder:
    """The encoder the app holds as ``role`` ("encoder", "reranker") when ``model`` names it; a 404 saying
    which one it holds (``verb``: what it does) or how to start one (``flag``) otherwise."""
    encoder: Encoder | None = getattr(request.app.state, role, None)
    if encoder is None:
        raise APIError(404,
                       f"model '{model}' not found; this server has no such model (start it with {flag})",
                       "model", "model_not_found")
    if not names(encoder, model):
        raise APIError(404, f"model '{model}' not found; this server {verb} with '{encoder.name}'", "model",
                       "model_not_found")
    return encoder


async def vectors_of(encoder: Encoder, inputs: list[list[int]], dimensions: int | None) -> torch.Tensor:
    """The inputs' embeddings, ``BATCH`` of similar lengths at a time (``length_batches``); cut to
    ``dimensions`` (and normalized again where the model normalizes)."""
    if not inputs or len(inputs) > MAX_INPUTS:
        raise APIError(400, f"input must hold 1 to {MAX_INPUTS} items", "input")
    if dimensions is not None and dimensions > encoder.config.dimensions:
        raise APIError(400, f"dimensions must be at most {encoder.config.dimensions}", "dimensions")
    vectors = torch.empty(len(inputs), encoder.config.dimensions)
    for batch in length_batches(inputs, BATCH):
        vectors[batch] = await admitted(encoder.aembed([inputs[i] for i in batch]), "input")
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
        if encoder.config.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
    return vectors


async def admitted(computed: Awaitable[torch.Tensor], param: str) -> torch.Tensor:
    """An encoder's answer (a BERT's in a worker thread; a decoder's through its engine, which batches every
    caller's inputs); what the engine refuses at admission is the request's error (a 4xx, or a 503)."""
    try:
        return await computed
    except Exception as e:
        error = engine_error(e, param)
        if error is None:
            raise
        raise error from None


async def tokens_of(encoder: Encoder, texts: list[str], truncate: bool = True) -> list[list[int]]:
    if any(not t for t in texts):
        raise APIError(400, "input must not hold an empty string", "input")
    try:
        return await asyncio.to_thread(encoder.tokenize, texts, truncate)
    except ValueError as e:
        raise APIError(400, str(e), "input") from None


@router.post("/v1/embeddings", response_model=None,
             responses=ok(EmbeddingsResponse, "The inputs' embeddings, in order") | openai_errors(
                 400, 404, 429, 501, 503))
async def embeddings(body: EmbeddingsRequest, request: Request) -> dict:
    async with embedding_model(request, body.model) as encoder:
        given = body.input
        if isinstance(given, str) or given and isinstance(given[0], int):
            given = [given]
        if given and isinstance(given[0], list):  # token ids, as the encoder's vocabulary numbers them
            vocab = encoder.config.vocab_size
            if any(not ids or len(ids) > encoder.config.max_seq_length or not all(0 <= t < vocab for t in ids)
                   for ids in given):
                raise APIError(400, f"token-id inputs must be 1 to {encoder.config.max_seq_length} ids in "
                                    f"[0, {vocab})", "input")
            tokens = [list(ids) for ids in given]
        else:
            tokens = await tokens_of(encoder, list(given))
        vectors = await vectors_of(encoder, tokens, body.dimensions)
        data = []
        for i, v in enumerate(vectors):
            value = (
                base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
                if body.encoding_format == "base64"
                else v.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        used = sum(len(t) for t in tokens)
        return {"object": "list", "data": data, "model": body.model,
                "usage": {"prompt_tokens": used, "total_tokens": used}}
