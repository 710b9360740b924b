"""Reranking beside the chat model: ``/v1/rerank`` (and llama.cpp's ``/rerank``) in the shape Cohere and
Jina define and llama.cpp and vLLM serve — a query and documents in, each document's relevance out, best
first — from the reranker ``kvserve serve --rerank-model PATH`` loads: a cross-encoder (``models.encoder``),
its pairs in a worker thread a batch at a time, never on the event loop; or a decoder judging yes/no
(``embedding.decoder_encoder``), its prompts through its engine's steps.
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from kvserve.models.encoder import Encoder
from kvserve.server.api_errors import APIError
from kvserve.server.embeddings_api import admitted, served_encoder
from kvserve.server.openapi_docs import ok, openai_errors
from kvserve.server.request_schema import NonEmptyStr, Strict

router = APIRouter(tags=["Rerank"])

MAX_DOCUMENTS = 1000  # Cohere's limit on one request's documents
BATCH = 32  # pairs the encoder reads at once


class DocumentText(Strict):
    text: str


class RerankRequest(Strict):
    model: str
    query: NonEmptyStr
    documents: list[str | DocumentText] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    max_chunks_per_doc: int | None = None  # Cohere's; documents are never split here
    user: str | None = None  # ignored


class RerankResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    model: str
    results: list[dict]  # {"index", "relevance_score", and "document": {"text"} when asked}
    usage: dict


def _reranker(request: Request, model: str) -> Encoder:
    return served_encoder(request, model, "reranker", "reranks",
                          "--rerank-model PATH, a cross-encoder's folder")


@router.post("/v1/rerank", response_model=None,
             responses=ok(RerankResponse, "The documents' relevance to the query, best first")
             | openai_errors(400, 404, 429, 503))
@router.post("/rerank", response_model=None, include_in_schema=False)
async def rerank(body: RerankRequest, request: Request) -> dict:
    encoder = _reranker(request, body.model)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    try:
        pairs = await asyncio.to_thread(encoder.tokenize_pairs, body.query, texts)
    except ValueError as e:
        raise APIError(400, str(e), "query") from None
    scores = []
    for i in range(0, len(pairs), BATCH):
        scores += (await admitted(encoder.ascore(pairs[i : i + BATCH]), "documents")).tolist()
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n]
    results = [
        {
            "index": i,
            "relevance_score": scores[i],
            **({"document": {"text": texts[i]}} if body.return_documents else {}),
        }
        for i in order
    ]
    used = sum(len(ids) for ids, _ in pairs)
    return {"id": f"rerank-{secrets.token_hex(12)}", "model": body.model, "results": results,
            "usage": {"prompt_tokens": used, "total_tokens": used}}
