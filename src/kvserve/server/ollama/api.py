"""Ollama-compatible endpoints: ``/api/generate``, ``/api/chat`` (NDJSON streams by default), ``/api/tags``,
``/api/ps``, ``/api/show``, ``/api/pull``, ``/api/delete``, ``/api/version``.

A request's ``num_ctx`` cannot resize the KV pool: it may shrink the context below the server's (the
prompt must fit in it and generation stops at it); a larger one is served at the server's context, as
Ollama serves what its memory allows, and the reply says so in ``X-KVServe-Num-Ctx`` and the log
(llama-index sends ``/api/show``'s trained context as ``num_ctx`` on every request).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve import __version__
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.constraints import Constraint
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import ModelLoadError, ModelNotFoundError
from kvserve.fim import hole_indent
from kvserve.models import registry
from kvserve.server.api_errors import APIError, engine_error, prompt_too_long
from kvserve.server.model_card import ModelCard
from kvserve.server.model_slots import keep_alive_seconds, served
from kvserve.server.ollama import bodies
from kvserve.server.ollama.errors import ollama_errors
from kvserve.server.ollama.replies import Reply, iso_stamp, now_stamp
from kvserve.server.ollama.schemas import (
    ChatRequest,
    DeleteRequest,
    GenerateRequest,
    Options,
    PullRequest,
    ShowRequest,
)
from kvserve.server.openapi_docs import documented, ndjson_stream, ok
from kvserve.server.serving import EngineStream, Serving, collect_finals, sampling_params
from kvserve.server.streaming import Tick, ndjson_line, ndjson_response
from kvserve.server.thinking import Thinking, ThoughtStream, template_switch
from kvserve.server.tools import Calls, ToolChoice, ToolUse, ToolUseError, parse_calls, text_to_stream

log = logging.getLogger(__name__)
router = APIRouter(tags=["Ollama"])

NEVER = "9999-12-31T23:59:59Z"  # expires_at of a model that stays loaded
PARAM_NAMES = {"repetition_penalty": "repeat_penalty", "logprobs": "top_logprobs"}


def ollama_params(
    options: Options | None,
    num_prompt_tokens: int,
    server_ctx: int,
    logprobs: int | None,
    constraint: Constraint | None = None,
    default_temperature: float | None = None,
) -> SamplingParams:
    """Ollama's defaults (temperature 0.8 unless the server's ``default_temperature``, top_k 40, top_p 0.9)
    except repeat_penalty, which is 1.0:
    Ollama's 1.1 applies to the last 64 tokens, a window this engine does not have."""
    o = options or Options()
    ctx = server_ctx
    if o.num_ctx is not None:
        ctx = min(o.num_ctx, server_ctx)  # a larger one: see the module's docstring
    if num_prompt_tokens >= ctx:
        raise prompt_too_long(num_prompt_tokens, ctx)
    room = ctx - num_prompt_tokens
    max_tokens = room if o.num_predict in (None, -1, -2) else min(o.num_predict, room)
    penalty = 1.0 if o.repeat_penalty is None or o.repeat_last_n == 0 else o.repeat_penalty
    return sampling_params(
        PARAM_NAMES,
        max_tokens=max_tokens,
        temperature=o.temperature if o.temperature is not None else
        (0.8 if default_temperature is None else default_temperature),
        top_k=40 if o.top_k is None else o.top_k,
        top_p=0.9 if o.top_p is None else o.top_p,
        min_p=o.min_p or 0.0,
        repetition_penalty=penalty,
        presence_penalty=o.presence_penalty or 0.0,
        frequency_penalty=o.frequency_penalty or 0.0,
        seed=None if o.seed in (None, -1) else o.seed,
        stop=tuple(o.stop or ()),
        logprobs=logprobs,
        constraint=constraint,
        num_keep=o.num_keep,
    )


async def _reply(request: Request, stream: EngineStream, reply: Reply, streaming: bool, heartbeat: float):
    if streaming:
        return ndjson_response(_lines(stream, reply, heartbeat), cleanup=stream.aclose)
    [final] = await collect_finals(request, [stream])
    thought, text, calls = reply.split(final.text)
    return reply.final(final, text, calls, thought)


async def _lines(stream: EngineStream, reply: Reply, heartbeat: float) -> AsyncIterator[bytes]:
    """Lines of no text while the prompt is read (every ``heartbeat`` seconds), then the answer. With tools,
    an answer that starts with a call is held back and its calls come whole in the last line (a call can only
    come first); text answers stream as usual."""
    holding = reply.tools_on is not None
    thoughts = ThoughtStream(reply.thinking)
    try:
        async with aclosing(stream.ticking(heartbeat)) as outputs:
            async for out in outputs:
                if isinstance(out, Tick):
                    yield ndjson_line(reply.part(""))
                    continue
                thought, answer = thoughts.feed(out)
                if thought:
                    yield ndjson_line(reply.part("", thought=thought))
                holding, text = text_to_stream(holding, answer, reply.tools_on)
                if text or (reply.want_logprobs and out.new_logprobs):
                    yield ndjson_line(reply.part(text, out))
                if out.finished:
                    held, calls = parse_calls(answer.text, reply.tools_on) if holding else ("", [])
                    yield ndjson_line(reply.final(out, held, calls))
    except (APIError, EngineDeadError) as e:
        yield ndjson_line({"error": (engine_error(e) or APIError(503, f"the engine failed: {e}")).message})


async def _load_reply(request: Request, body, chat: bool) -> dict:
    """What Ollama answers to an empty prompt: the model is loaded (``done_reason: "load"``), or with
    ``keep_alive`` 0 unloaded (``"unload"``; not while a stream is open on it)."""
    obj: dict = {"model": body.model, "created_at": now_stamp()}
    obj |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    models = request.app.state.models
    if keep_alive_seconds(body.keep_alive, None) == 0 and await models.release(body.model):
        return obj | {"done": True, "done_reason": "unload"}
    await models.serving(body.model, body.keep_alive)
    return obj | {"done": True, "done_reason": "load"}


STREAMED = "NDJSON lines as the answer is generated (the default), or one object with stream: false"


@documented(router.post, "/api/generate", bodies.GenerateResponse, STREAMED,
            ndjson_stream(bodies.GenerateResponse, bodies.OllamaError), ollama_errors(400, 404, 503))
async def generate(body: GenerateRequest, request: Request):
    received = time.perf_counter()
    if not body.prompt and not body.context:
        return await _load_reply(request, body, chat=False)
    serving = await served(request, body.model, body.keep_alive)
    if body.raw and body.system:
        raise APIError(400, "system has no effect with raw: true; put it in the prompt")
    context = list(body.context or [])
    if body.suffix:  # as Ollama: the prompt and suffix through the model's fill-in-the-middle form
        ids = context + await serving.encode_fim(body.prompt or "", body.suffix)
        return await _run(request, serving, body, ids, chat=False, received=received,
                          stop_token_ids=serving.tokenizer.fim.ends,
                          stop_at_dedent=hole_indent(body.prompt or ""))
    if body.raw:
        ids = context + await serving.encode_text(body.prompt or "", add_special=not context)
        return await _run(request, serving, body, ids, chat=False, received=received)
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": body.prompt or ""})
    enable, variables = _thinking_switch(serving, body)
    ids = context + await serving.encode_chat(messages, add_special=not context, template_variables=variables)
    return await _run(request, serving, body, ids, chat=False, received=received,
                      thinking=serving.thinking(ids, enable))


@documented(router.post, "/api/chat", bodies.ChatResponse, STREAMED,
            ndjson_stream(bodies.ChatResponse, bodies.OllamaError), ollama_errors(400, 404, 503))
async def chat(body: ChatRequest, request: Request):
    received = time.perf_counter()
    if not body.messages:
        return await _load_reply(request, body, chat=True)
    serving = await served(request, body.model, body.keep_alive)
    tools = [t.tool() for t in body.tools or []]
    try:
        use = ToolUse.decide(tools, ToolChoice(), body.format_constraint, "format", serving.call_format,
                             serving.written)
    except ToolUseError as e:  # Ollama's errors name no field: the answer format's say so in the message
        raise APIError(400, f"format: {e}" if e.param == "format" else str(e)) from None
    enable, variables = _thinking_switch(serving, body)
    ids = await serving.encode_chat([m.for_template() for m in body.messages], tools=tools,
                                    template_variables=variables)
    return await _run(request, serving, body, ids, chat=True, received=received,
                      calls=use.constraint if tools else None, tools_on=use.calls,
                      thinking=serving.thinking(ids, enable))


def _thinking_switch(serving: Serving, body) -> tuple[bool | None, dict]:
    """``think`` as the template's variables; true for a model that does not think is a 400, as in Ollama."""
    enable, level = body.thinking_switch
    if enable and not serving.tokenizer.thinks:
        raise APIError(400, f'"{body.model}" does not support thinking')
    enable = serving.thinking_switch(enable)
    return enable, template_switch(enable, level)


async def _run(
    request: Request, serving: Serving, body, ids: list[int], chat: bool, received: float, calls=None,
    stop_token_ids: tuple[int, ...] = (), thinking: Thinking | None = None, tools_on: Calls | None = None,
    stop_at_dedent: int = 0,
):
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    try:
        constraint = calls or body.format_constraint()
    except ValueError as e:
        raise APIError(400, f"format: {e}") from None
    params = ollama_params(body.options, len(ids), serving.max_model_len, logprobs, constraint,
                           serving.config.temperature)
    if stop_token_ids or stop_at_dedent:
        params = replace(params, stop_token_ids=(*params.stop_token_ids, *stop_token_ids),
                         stop_at_dedent=stop_at_dedent)
    if thinking is not None:
        params = replace(params, reasoning=thinking.reasoning)
    stream = await serving.start(ids, params, f"ollama-{uuid.uuid4().hex}")
    reply = Reply(body.model, chat, received, logprobs is not None,
                  tools_on=tools_on, thinking=thinking)
    result = await _reply(request, stream, reply, body.stream is not False, serving.config.heartbeat_seconds)
    asked = body.options.num_ctx if body.options else None
    if asked is not None and asked > serving.max_model_len:
        log.info("num_ctx %d asked, served at the server's context of %d tokens", asked,
                 serving.max_model_len)
        headers = {"X-KVServe-Num-Ctx": str(serving.max_model_len)}
        if isinstance(result, dict):
            return JSONResponse(result, headers=headers)
        result.headers.update(headers)
    return result


# --- models -----------------------------------------------------------------------------------------
async def _model_entry(card: ModelCard) -> dict:
    digest = await asyncio.to_thread(card.digest)
    return {
        "name": card.ollama_name,
        "model": card.ollama_name,
        "modified_at": iso_stamp(card.modified),
        "size": card.size_bytes,
        "digest": digest,
        "details": card.details(),
    }


def _cards(request: Request) -> list[ModelCard]:
    """Every model this server serves: its chat models, loaded or not, then its embedding and rerank
    models."""
    return [slot.card for slot in request.app.state.models.slots] + request.app.state.encoder_cards


@router.get("/api/tags", response_model=None,
            responses=ok(bodies.Tags, "The models this server serves, loaded or not"))
async def tags(request: Request) -> dict:
    return {"models": [await _model_entry(card) for card in _cards(request)]}


@router.get("/api/ps", response_model=None,
            responses=ok(bodies.Ps, "The loaded models, each with when it unloads"))
async def ps(request: Request) -> dict:
    models = []
    for slot in request.app.state.models.loaded():
        models.append(await _running_entry(slot.card, slot.expires_at()))
    for card in request.app.state.encoder_cards:  # embedding and rerank models: loaded for good
        models.append(await _running_entry(card, None))
    return {"models": models}


async def _running_entry(card: ModelCard, expires: float | None) -> dict:
    entry = await _model_entry(card)
    size = card.size_bytes + card.kv_pool_bytes
    entry |= {
        "expires_at": NEVER if expires is None else iso_stamp(expires),
        "size": size,
        "size_vram": size if card.device.startswith("cuda") else 0,
        "context_length": card.context_length,
    }
    del entry["modified_at"]
    return entry


@router.post(
    "/api/show",
    response_model=None,
    responses=ok(bodies.Show, "The model's details") | ollama_errors(400, 404),
)
async def show(body: ShowRequest, request: Request) -> dict:
    encoder = next((card for card in request.app.state.encoder_cards if card.matches(body.model_name)), None)
    if encoder is not None:
        return _show_encoder(request, encoder)
    slot = request.app.state.models.find(body.model_name)  # shown from its file's header unless loaded:
    card = slot.card  # showing a model does not load it (nor evict another), as Ollama's show does not
    if slot.serving is not None:
        c = slot.serving.async_engine.engine.model_config
    else:
        from kvserve.plan.model_spec import resolve_model

        c = (await asyncio.to_thread(resolve_model, slot.source)).config
    arch = card.architecture
    info = {
        "general.architecture": arch,
        "general.parameter_count": card.num_parameters,
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.block_count": c.num_layers,
        f"{arch}.attention.head_count": c.num_heads,
        f"{arch}.attention.head_count_kv": c.num_kv_heads,
        f"{arch}.rope.freq_base": c.rope_theta,
        f"{arch}.vocab_size": c.vocab_size,
    }
    return {
        "modelfile": f"FROM {card.path}\nPARAMETER num_ctx {card.context_length}\n",
        "parameters": f"num_ctx {card.context_length}",
        "template": card.chat_template,  # jinja2 (the model's own), not a Go template
        "details": card.details(),
        "model_info": info,
        "capabilities": ["completion", "tools", *(["insert"] if card.fim else [])],  # insert: FIM (suffix)
        "modified_at": iso_stamp(card.modified),
    }


def _show_encoder(request: Request, card: ModelCard) -> dict:
    """An embedding or rerank model's details, as Ollama shows an embedding model's ("embedding")."""
    state = request.app.state
    encoder = next(e for e in (state.encoder, state.reranker) if e is not None and card.matches(e.name))
    c, arch = encoder.config, card.architecture
    info = {"general.architecture": arch, "general.parameter_count": card.num_parameters,
            f"{arch}.context_length": c.max_seq_length, f"{arch}.embedding_length": c.hidden_size,
            f"{arch}.block_count": c.num_layers, f"{arch}.attention.head_count": c.num_heads,
            f"{arch}.pooling_type": c.pooling, f"{arch}.vocab_size": c.vocab_size}
    return {"modelfile": f"FROM {card.path}\n", "parameters": "", "template": "", "details": card.details(),
            "model_info": info, "capabilities": ["embedding"] if encoder is state.encoder else ["rerank"],
            "modified_at": iso_stamp(card.modified)}


def _registry_error(error: ModelLoadError) -> APIError:
    if isinstance(error, registry.PullError):
        return APIError(502, str(error))
    return APIError(404 if isinstance(error, ModelNotFoundError) else 400, str(error), "model")


@router.post(
    "/api/pull",
    response_model=None,
    responses=ok(bodies.PullStatus, "The model is on this machine",
                 ndjson_stream(bodies.PullStatus, bodies.OllamaError))
    | ollama_errors(400, 404, 502),
)
async def pull(body: PullRequest, request: Request):
    """A registry model's packages installed (``kvserve pull``): NDJSON progress lines ending with
    ``{"status": "success"}``, or that line alone with ``stream: false``. The server goes on serving
    its own model; the pulled one is there for ``kvserve serve`` and ``kvserve run``."""
    name = body.model_name
    try:
        registry.entry_for(name)
    except ModelNotFoundError as e:
        raise _registry_error(e) from None
    if body.stream is False:
        try:
            await asyncio.to_thread(registry.pull, name)
        except ModelLoadError as e:
            raise _registry_error(e) from None
        return {"status": "success"}
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[dict | None] = asyncio.Queue()

    def progress(status: dict) -> None:
        loop.call_soon_threadsafe(lines.put_nowait, status)

    async def run() -> None:
        try:
            await asyncio.to_thread(registry.pull, name, progress)
        except ModelLoadError as e:
            lines.put_nowait({"error": str(e)})
        finally:
            lines.put_nowait(None)

    task = asyncio.ensure_future(run())

    async def stream() -> AsyncIterator[bytes]:
        while (line := await lines.get()) is not None:
            yield ndjson_line(line)
        await task

    return ndjson_response(stream())


@router.delete(
    "/api/delete",
    response_model=None,
    responses={200: {"description": "The model's files and packages are removed"}} | ollama_errors(
        400, 404, 409, 502),
)
async def delete(body: DeleteRequest, request: Request) -> Response:
    """A registry model removed from this machine (its joined file and its packages); not the one this
    server serves (409)."""
    if any(card.matches(body.model_name) for card in _cards(request)):
        raise APIError(409, f"model '{body.model_name}' is the one this server serves: stop it first",
                       "model")
    try:
        await asyncio.to_thread(registry.delete, body.model_name)
    except ModelLoadError as e:
        raise _registry_error(e) from None
    return Response(status_code=200)  # Ollama's: an empty 200


@router.get("/api/version", response_model=None, responses=ok(bodies.Version, "kvserve's version"))
async def version() -> dict:
    return {"version": __version__}
