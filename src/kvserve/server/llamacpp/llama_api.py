"""llama.cpp's own server routes, in its shapes: ``/tokenize``, ``/detokenize`` and ``/infill`` (code
completion between a prefix and a suffix, as editors' plugins such as llama.vscode drive it).

``/infill`` writes the prompt with the model's fill-in-the-middle tokens (``Tokenizer.encode_fim``) and
stops at any token that ends a middle; a model without such tokens is a 400.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.outputs import RequestOutput
from kvserve.server.api_errors import APIError, engine_error, generation_error
from kvserve.server.model_slots import served
from kvserve.server.openapi_docs import documented, ok, openai_errors, sse_stream
from kvserve.server.serving import EngineStream, collect_finals, sampling_params
from kvserve.server.streaming import sse_event, sse_response
from kvserve.server.strict_schema import Strict, Tokens

router = APIRouter(tags=["llama.cpp"])


class TokenizeRequest(Strict):
    content: str
    add_special: bool = False
    with_pieces: bool = False
    model: str | None = None  # default: the server's first model


class TokenPiece(BaseModel):
    id: int
    piece: str


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]


class DetokenizeRequest(Strict):
    tokens: Tokens
    model: str | None = None


class DetokenizeResponse(BaseModel):
    content: str


class ExtraFile(Strict):
    filename: str = ""
    text: str = ""


class InfillRequest(Strict):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""  # the start of the middle, already typed
    n_indent: int = Field(0, ge=0)  # the middle ends at a line indented less (editors send the hole's indent)
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0)
    top_k: int = Field(40, ge=-1)
    top_p: float = Field(0.95, gt=0, le=1)
    min_p: float = Field(0.05, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, lt=2**64)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    cache_prompt: bool | None = None  # the prefix cache is always on
    model: str | None = None


class InfillResponse(BaseModel):
    content: str
    stop: bool
    stop_type: str
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    timings: dict[str, float]


@router.post("/tokenize", response_model=None, responses=ok(TokenizeResponse, "The text's token ids")
             | openai_errors(400, 404, 503))
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    serving = await served(request, body.model)
    ids = await serving.encode_text(body.content, add_special=body.add_special, param="content")
    if not body.with_pieces:
        return {"tokens": ids}
    tokenizer = serving.tokenizer
    return {"tokens": [{"id": i, "piece": tokenizer.decode([i], skip_special_tokens=False)} for i in ids]}


@router.post("/detokenize", response_model=None, responses=ok(DetokenizeResponse, "The tokens' text")
             | openai_errors(400, 404, 503))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    serving = await served(request, body.model)
    vocab = serving.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
    return {"content": serving.decode(body.tokens)}


@documented(router.post, "/infill", InfillResponse, "The middle; with stream: true, server-sent events of its pieces",
            sse_stream(InfillResponse), openai_errors(400, 404, 429, 503))
async def infill(body: InfillRequest, request: Request):
    serving = await served(request, body.model)
    ids = await serving.encode_fim(body.input_prefix, body.input_suffix,
                                   [(f.filename, f.text) for f in body.input_extra], body.prompt)
    room = serving.max_model_len - len(ids)
    params = sampling_params(
        None,
        max_tokens=max(1, room if body.n_predict < 0 else min(body.n_predict, room)),
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        seed=None if body.seed in (None, -1) else body.seed,
        stop=tuple(body.stop),
        stop_token_ids=serving.tokenizer.fim.ends,
        stop_at_dedent=body.n_indent,
    )
    stream = await serving.start(ids, params, f"infill-{uuid.uuid4().hex}", param="input_prefix")
    model = serving.card.name
    if body.stream:
        return sse_response(_events(stream, model), cleanup=stream.aclose)
    [final] = await collect_finals(request, [stream])
    return _final(final, model)


def _final(out: RequestOutput, model: str, content: str | None = None) -> dict[str, Any]:
    if out.finish_reason == "error":
        raise generation_error(out)
    m = out.metrics
    decode_s = max(m.decode_time, 1e-9)
    return {
        "content": out.text if content is None else content,
        "stop": True,
        "stop_type": "limit" if out.finish_reason == "length" else "eos",
        "model": model,
        "tokens_predicted": m.num_generation_tokens,
        "tokens_evaluated": m.num_prompt_tokens,
        "timings": {"predicted_n": m.num_generation_tokens,
                    "predicted_per_second": m.num_generation_tokens / decode_s},
    }


async def _events(stream: EngineStream, model: str) -> AsyncIterator[bytes]:
    try:
        async with aclosing(stream.__aiter__()) as outputs:
            async for out in outputs:
                if out.delta_text:
                    yield sse_event({"content": out.delta_text, "stop": False})
                if out.finished:
                    yield sse_event(_final(out, model, content=""))
    except (APIError, EngineDeadError) as e:
        error = engine_error(e) or APIError(503, f"the engine failed: {e}")
        yield sse_event({"error": {"code": error.status, "message": error.message}})
