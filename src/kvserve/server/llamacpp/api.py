"""llama.cpp's own server routes, in its shapes: ``/tokenize``, ``/detokenize`` and ``/infill`` (code
completion between a prefix and a suffix, as editors' plugins such as llama.vscode drive it).

``/infill`` writes the prompt with the model's fill-in-the-middle tokens (``Tokenizer.encode_fim``) and
stops at any token that ends a middle; a model without such tokens is a 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.outputs import RequestOutput
from kvserve.server.api_errors import APIError, engine_error, generation_error
from kvserve.server.model_slots import served
from kvserve.server.openapi_docs import documented, ok, openai_errors, sse_stream
from kvserve.server.request_schema import Strict, Tokens
from kvserve.server.serving import EngineStream, sampling_params
from kvserve.server.streaming import SSE_PING, Tick, cancel_on_disconnect, sse_event, sse_response

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
    ignored_fields = frozenset({"time"})  # llama.vim's note of when it picked the chunk
    filename: str = ""
    text: str = ""


# llama.cpp's sampler names (``samplers``): the ones this server has, by the parameter each reads
SAMPLER_PARAMS = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "temperature": "temperature"}
# the others: at their defaults they change nothing (DRY, XTC, typical-p, top-n-sigma and the penalties are
# off unless their own parameters are sent, which this endpoint does not take), and "infill" is llama.cpp's
# sampler for a middle's end, which this server finds by the FIM end tokens and the hole's indentation instead
NEUTRAL_SAMPLERS = {"penalties", "dry", "typ_p", "typical_p", "xtc", "top_n_sigma", "infill"}
SAMPLER_LETTERS = {"k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "e": "penalties", "d": "dry",
                   "y": "typ_p", "x": "xtc", "s": "top_n_sigma", "i": "infill"}


class InfillRequest(Strict):
    """llama.cpp's ``/infill`` body, as llama.vim and llama.vscode send it. ``id_slot`` (which of llama.cpp's
    slots keeps the prompt: the prefix cache here is shared), ``t_max_prompt_ms`` (not acted on by llama.cpp
    either) and ``penalty_last_n`` (no penalty is applied here) are accepted and ignored."""

    ignored_fields = frozenset({"id_slot", "t_max_prompt_ms", "penalty_last_n"})
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""  # the start of the middle, already typed
    n_indent: int = Field(0, ge=0)  # the middle ends at a line indented less (editors send the hole's indent)
    n_predict: int = Field(-1, ge=-1)  # 0: the prompt is read into the cache, nothing is generated
    temperature: float | None = Field(None, ge=0)  # default: the server's --temperature, else 0.8
    top_k: int = Field(40, ge=-1)
    top_p: float = Field(0.95, gt=0, le=1)
    min_p: float = Field(0.05, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, lt=2**64)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    cache_prompt: bool | None = None  # the prefix cache is always on
    model: str | None = None  # default: the first served model with fill-in-the-middle tokens
    samplers: list[str] | str | None = None  # which samplers run (llama.cpp's names or letters); None: all
    # stop once this long after the first token, at a line end
    t_max_predict_ms: int | None = Field(None, ge=0)
    response_fields: list[str] | None = None  # only these fields ("timings/prompt_n": a nested one) are sent

    @field_validator("samplers")
    @classmethod
    def known_samplers(cls, value: list[str] | str | None) -> list[str] | str | None:
        names = [SAMPLER_LETTERS.get(c, c) for c in value] if isinstance(value, str) else value or []
        unknown = [n for n in names if n not in SAMPLER_PARAMS and n not in NEUTRAL_SAMPLERS]
        if unknown:
            raise ValueError(f"unknown sampler {unknown[0]!r}; llama.cpp's are "
                             f"{', '.join(sorted({*SAMPLER_PARAMS, *NEUTRAL_SAMPLERS}))}")
        return value

    def sampler_values(self, temperature: float) -> dict[str, float]:
        """temperature, top_k, top_p, min_p as the ``samplers`` list leaves them: one left out of the list
        does nothing (a temperature of 1, no top-k cut...), as in llama.cpp's sampler chain."""
        values = {"temperature": temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}
        if self.samplers is None:
            return values
        names = {SAMPLER_LETTERS.get(c, c) for c in self.samplers} if isinstance(self.samplers, str) \
            else set(self.samplers)
        off = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        return {k: (v if k in names else off[k]) for k, v in values.items()}


class InfillResponse(BaseModel):
    """The middle and its timings, as llama.cpp answers; with ``response_fields``, only those (a nested one
    under its path: "timings/prompt_n")."""

    model_config = ConfigDict(extra="allow")
    content: str | None = None
    stop: bool | None = None
    stop_type: str | None = None
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    tokens_cached: int | None = None
    truncated: bool | None = None
    timings: dict[str, float] | None = None


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


@documented(router.post, "/infill", InfillResponse,
            "The middle; with stream: true, server-sent events of its pieces", sse_stream(InfillResponse),
            openai_errors(400, 404, 429, 503))
async def infill(body: InfillRequest, request: Request):
    serving = await served(request, body.model if body.model is not None else _fim_model(request))
    ids = await serving.encode_fim(body.input_prefix, body.input_suffix,
                                   [(f.filename, f.text) for f in body.input_extra], body.prompt)
    room = serving.max_model_len - len(ids)
    values = body.sampler_values(serving.config.temperature_for(body.temperature, 0.8))
    params = sampling_params(
        None,
        max_tokens=max(1, room if body.n_predict < 0 else min(body.n_predict, room)),
        temperature=values["temperature"],
        top_k=values["top_k"],
        top_p=values["top_p"],
        min_p=values["min_p"],
        seed=None if body.seed in (None, -1) else body.seed,
        stop=tuple(body.stop),
        stop_token_ids=serving.tokenizer.fim.ends,
        stop_at_dedent=body.n_indent,
    )
    stream = await serving.start(ids, params, f"infill-{uuid.uuid4().hex}", param="input_prefix")
    reply = _InfillReply(serving.card.name, body)
    if body.stream:
        return sse_response(_events(stream, reply, serving.config.heartbeat_seconds), cleanup=stream.aclose)
    final = await cancel_on_disconnect(request, reply.final_output(stream))
    return reply.final(final)


def _fim_model(request: Request) -> str | None:
    """A request that names no model goes to the first served model with fill-in-the-middle tokens (editor
    plugins send none), or the default model when none has them (which then says so)."""
    for slot in request.app.state.models.slots:
        if slot.card.fim:
            return slot.name
    return None


class _InfillReply:
    """One /infill answer: the middle, cut at ``t_max_predict_ms`` (at a line's end, as llama.cpp does), and
    only the ``response_fields`` asked for."""

    def __init__(self, model: str, body: InfillRequest) -> None:
        self.model = model
        self.body = body
        self.cut = False  # t_max_predict_ms ended it

    def over_time(self, out: RequestOutput) -> bool:
        limit, first = self.body.t_max_predict_ms, out.metrics.first_token_time
        if out.finished or limit is None or first is None or "\n" not in out.text:
            return False
        return (time.perf_counter() - first) * 1000 >= limit

    async def final_output(self, stream: EngineStream) -> RequestOutput:
        """The last output, the request ended early (aborted: its blocks freed) once ``over_time``."""
        last = None
        try:
            async with aclosing(stream.__aiter__()) as outputs:
                async for out in outputs:
                    last = out
                    if self.over_time(out):
                        self.cut = True
                        break
        except EngineDeadError as e:
            raise engine_error(e) from None
        finally:
            await stream.aclose()
        return last

    def final(self, out: RequestOutput, content: str | None = None) -> dict[str, Any]:
        if out.finish_reason == "error":
            raise generation_error(out)
        m = out.metrics
        end = m.last_token_time or time.perf_counter()
        prompt_s = max((m.first_token_time or end) - (m.first_scheduled_time or m.arrival_time), 1e-9)
        decode_s = max(m.decode_time, 1e-9)
        computed = m.num_prompt_tokens - m.num_cached_tokens
        text = "" if self.body.n_predict == 0 else out.text  # 0: the prompt only, read into the cache
        predicted = 0 if self.body.n_predict == 0 else m.num_generation_tokens
        response = {
            "content": text if content is None else content,
            "stop": True,
            "stop_type": "limit" if out.finish_reason == "length" or self.cut else "eos",
            "model": self.model,
            "tokens_predicted": predicted,
            "tokens_evaluated": m.num_prompt_tokens,
            "tokens_cached": m.num_prompt_tokens + predicted,
            "truncated": False,
            "timings": {"prompt_n": computed, "prompt_ms": prompt_s * 1000,
                        "prompt_per_token_ms": prompt_s * 1000 / max(computed, 1),
                        "prompt_per_second": computed / prompt_s, "predicted_n": predicted,
                        "predicted_ms": decode_s * 1000,
                        "predicted_per_token_ms": decode_s * 1000 / max(predicted, 1),
                        "predicted_per_second": predicted / decode_s},
        }
        return _fields(response, self.body.response_fields)


def _fields(response: dict[str, Any], wanted: list[str] | None) -> dict[str, Any]:
    """llama.cpp's ``response_fields``: only those, a nested one under its path ("timings/prompt_n");
    a name that is none of the response's is left out."""
    if wanted is None:
        return response
    out = {}
    for path in wanted:
        value: Any = response
        for part in path.split("/"):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            out[path] = value
    return out


_MISSING = object()


async def _events(stream: EngineStream, reply: _InfillReply, heartbeat: float) -> AsyncIterator[bytes]:
    yield SSE_PING  # at once: the stream is open while the prompt is read
    try:
        async with aclosing(stream.ticking(heartbeat)) as outputs:
            async for out in outputs:
                if isinstance(out, Tick):
                    yield SSE_PING
                    continue
                if out.delta_text and reply.body.n_predict != 0:
                    yield sse_event({"content": out.delta_text, "stop": False})
                if out.finished or reply.over_time(out):
                    reply.cut = not out.finished
                    yield sse_event(reply.final(out, content=""))
                    return
    except (APIError, EngineDeadError) as e:
        error = engine_error(e) or APIError(503, f"the engine failed: {e}")
        yield sse_event({"error": {"code": error.status, "message": error.message}})
