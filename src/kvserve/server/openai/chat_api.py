"""OpenAI-compatible endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from datetime import UTC, datetime

from fastapi import APIRouter, Request

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.constraints import Constraint
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.fim import hole_indent
from kvserve.server.api_errors import APIError, engine_error, openai_error_body
from kvserve.server.embeddings_api import names
from kvserve.server.model_card import ModelCard
from kvserve.server.model_slots import served
from kvserve.server.openai import chat_bodies
from kvserve.server.openai.chat_replies import (
    ChunkMaker,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    prompt_usage,
    usage,
)
from kvserve.server.openai.chat_schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvserve.server.openapi_docs import documented, ok, openai_errors, sse_stream
from kvserve.server.server_config import ServerConfig
from kvserve.server.serving import EngineStream, Serving, collect_finals, merge, sampling_params
from kvserve.server.streaming import SSE_DONE, SSE_PING, Tick, sse_event, sse_response, with_ticks
from kvserve.server.thinking import Thinking, ThoughtStream
from kvserve.server.tools import Calls, ToolCall, ToolUse, parse_calls, text_to_stream

router = APIRouter(tags=["OpenAI"])

PARAM_NAMES = {"repetition_penalty": "repetition_penalty", "logprobs": "top_logprobs"}


def _params(
    body: SamplingFields, config: ServerConfig, max_tokens: int | None, logprobs: int | None, choice: int,
    constraint: Constraint | None = None,
) -> SamplingParams:
    seed = body.seed
    if seed is not None and choice:
        seed = (seed + choice) % 2**64  # the n choices of a seeded request differ, reproducibly
    return sampling_params(
        PARAM_NAMES,
        max_tokens=max_tokens,
        temperature=config.temperature_for(body.temperature, 1.0),
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=seed,
        stop=tuple(body.stop or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        constraint=constraint,
        logit_bias={int(t): b for t, b in (body.logit_bias or {}).items()},
    )


def _check_common(body: SamplingFields, serving: Serving) -> int:
    if body.logit_bias and any(int(t) >= serving.vocab_size for t in body.logit_bias):
        raise APIError(400, f"logit_bias names a token id beyond the vocabulary of {serving.vocab_size}",
                       "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    n = body.n or 1
    if n > serving.config.max_n:
        raise APIError(400, f"n must be at most {serving.config.max_n}, got {n}", "n")
    return n


def _tool_use(body: ChatCompletionRequest, serving: Serving) -> ToolUse:
    """What tools, tool_choice, parallel_tool_calls and response_format make of the answer."""
    tools = [t.tool() for t in body.tools or []]
    answer = body.response_format.constraint if body.response_format else lambda: None
    return serving.tool_use(tools, body.tool_choice_spec(), answer, "response_format")


def _assistant_message(out: RequestOutput, tools_on: Calls | None,
                       thinking: Thinking | None = None) -> tuple[dict, str]:
    """(the message, its finish_reason): tool calls when the answer is calls; a reasoning model's
    thought as ``reasoning_content``."""
    reason = finish_reason(out)
    thought, text = thinking.split(out.text) if thinking is not None else (None, out.text)
    extra = {"reasoning_content": thought} if thought is not None else {}
    if tools_on:
        content, calls = parse_calls(text, tools_on)
        if calls:
            message = {"role": "assistant", "content": content or None, "refusal": None,
                       "tool_calls": [_call_record(c) for c in calls], **extra}
            return message, "tool_calls"
    return {"role": "assistant", "content": text, "refusal": None, **extra}, reason


def _call_record(call: ToolCall) -> dict:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _stream_error(e: Exception) -> dict:
    return openai_error_body(engine_error(e) or APIError(503, f"the engine failed: {e}", code="engine_dead"))


# --- /v1/chat/completions ---------------------------------------------------------------------------
STREAMED = "The completion; with stream: true, chunks as server-sent events"


@documented(router.post, "/v1/chat/completions", chat_bodies.ChatCompletion, STREAMED,
            sse_stream(chat_bodies.ChatCompletionChunk), openai_errors(400, 404, 429, 503))
async def chat_completions(body: ChatCompletionRequest, request: Request):
    serving = await served(request, body.model)
    n = _check_common(body, serving)
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        raise APIError(400, "give max_completion_tokens or max_tokens, not both", "max_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    use = _tool_use(body, serving)
    enable, variables = body.thinking_switch()
    enable = serving.thinking_switch(enable)
    if enable is not None:
        variables["enable_thinking"] = enable
    prompt = await serving.encode_chat([m.for_template() for m in body.messages], tools=use.shown,
                                       template_variables=variables)
    thinking = serving.thinking(prompt, enable)
    params = [_params(body, serving.config, max_tokens, logprobs, i, use.constraint) for i in range(n)]
    if thinking is not None:
        params = [replace(p, reasoning=thinking.reasoning) for p in params]
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await serving.start_all(
        [(prompt, p, f"{response_id}-{i}") for i, p in enumerate(params)], param="messages"
    )
    maker = ChunkMaker(response_id, int(time.time()), body.model, "chat.completion.chunk", body.include_usage)
    tools_on = use.calls
    if body.stream:
        events = _chat_events(streams, maker, n, logprobs is not None, tools_on, thinking,
                              _Waiting(serving, body.return_progress))
        return sse_response(events, cleanup=_closer(streams))
    finals = await collect_finals(request, streams)
    choices = []
    for i, out in enumerate(finals):
        message, reason = _assistant_message(out, tools_on, thinking)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(out.logprobs),
                        "finish_reason": reason})
    return maker.final("chat.completion", choices, usage(*prompt_usage([finals]), finals))


class _Waiting:
    """What a stream sends while its prompt is read: an SSE comment every ``heartbeat_seconds``, or with
    llama.cpp's ``return_progress``, a chunk of no choices with its ``prompt_progress`` every second."""

    def __init__(self, serving: Serving, progress: bool | None) -> None:
        self.progress = bool(progress)
        self.every = min(1.0,
                         serving.config.heartbeat_seconds) if progress else serving.config.heartbeat_seconds

    def ticking(self, streams: list[EngineStream]):
        return with_ticks(merge(streams), self.every)

    def event(self, streams: list[EngineStream], maker: ChunkMaker) -> bytes:
        if not self.progress:
            return SSE_PING
        p = streams[0].progress()  # the streams of one request share its prompt
        progress = {"total": p.total, "cache": p.cached, "processed": p.computed,
                    "time_ms": round((time.perf_counter() - p.arrival) * 1000, 1)}
        return sse_event({**maker.chunk([]), "prompt_progress": progress})


async def _chat_events(
    streams: list[EngineStream], maker: ChunkMaker, n: int, want_logprobs: bool, tools_on: Calls | None,
    thinking: Thinking | None, waiting: _Waiting,
) -> AsyncIterator[bytes]:
    """The role chunk at once, ``waiting``'s events while the prompt is read, then the answer. With tools,
    an answer that starts with a call (the grammar lets a call come first only) is held back and sent as
    whole tool calls when it ends; text answers stream as usual."""
    for i in range(n):
        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
        yield sse_event(maker.chunk([first]))
    finals: list[RequestOutput] = []
    holding = [tools_on is not None] * n  # still undecided or a call: text held back
    thoughts = [ThoughtStream(thinking) for _ in range(n)]
    try:
        async with aclosing(waiting.ticking(streams)) as outputs:
            async for item in outputs:
                if isinstance(item, Tick):
                    yield waiting.event(streams, maker)
                    continue
                i, out = item
                thought, answer = thoughts[i].feed(out)
                if thought:
                    yield sse_event(maker.chunk([{"index": i, "delta": {"reasoning_content": thought},
                                                  "logprobs": None, "finish_reason": None}]))
                holding[i], text = text_to_stream(holding[i], answer, tools_on)
                if text or (want_logprobs and out.new_logprobs):
                    delta = {"index": i, "delta": {"content": text},
                             "logprobs": chat_logprobs(out.new_logprobs), "finish_reason": None}
                    yield sse_event(maker.chunk([delta]))
                if out.finished:
                    finals.append(out)
                    message, reason = _assistant_message(out, tools_on, thinking)
                    if holding[i] and (held := _held_delta(message)):
                        yield sse_event(maker.chunk([{"index": i, "delta": held, "logprobs": None,
                                                      "finish_reason": None}]))
                    done = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
                    yield sse_event(maker.chunk([done]))
    except (APIError, EngineDeadError) as e:
        yield sse_event(_stream_error(e))
        yield SSE_DONE
        return
    if maker.include_usage:
        yield sse_event(maker.chunk([], usage(*prompt_usage([finals]), finals)))
    yield SSE_DONE


def _held_delta(message: dict) -> dict:
    """What a held-back answer still has to send when it ends: its text and its calls whole, each call with
    the ``index`` a streamed delta names it by; empty when there is neither."""
    held = {"content": message["content"]} if message["content"] else {}
    if message.get("tool_calls"):
        held["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
    return held


# --- /v1/completions --------------------------------------------------------------------------------
@documented(router.post, "/v1/completions", chat_bodies.Completion, STREAMED,
            sse_stream(chat_bodies.CompletionChunk), openai_errors(400, 404, 429, 503))
async def completions(body: CompletionRequest, request: Request):
    serving = await served(request, body.model)
    n = _check_common(body, serving)
    if body.best_of not in (None, 1, n):
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if body.echo and body.logprobs is not None:
        raise APIError(
            400, "echo with logprobs needs prompt logprobs, which this server does not compute", "echo"
        )
    prompts = await _completion_prompts(body, serving)
    params = [_params(body, serving.config, body.max_tokens or 16, body.logprobs, j) for j in range(n)]
    if body.suffix is not None:  # the middle ends where the model says, or where it leaves the hole
        ends = serving.tokenizer.fim.ends
        indent = hole_indent(body.prompt if isinstance(body.prompt, str) else "")
        params = [replace(p, stop_token_ids=(*p.stop_token_ids, *ends),
                          stop_at_dedent=indent) for p in params]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await serving.start_all(
        [(ids, params[j], f"{response_id}-{p * n + j}") for p, ids in enumerate(prompts) for j in range(n)],
        param="prompt",
    )
    echoes = [serving.decode(ids) if body.echo else "" for ids in prompts for _ in range(n)]
    maker = ChunkMaker(response_id, int(time.time()), body.model, "text_completion", body.include_usage)
    if body.stream:
        events = _completion_events(streams, maker, echoes, n, body.logprobs,
                                    _Waiting(serving, body.return_progress))
        return sse_response(events, cleanup=_closer(streams))
    finals = await collect_finals(request, streams)
    choices = [
        {
            "index": i,
            "text": echoes[i] + out.text,
            "logprobs": completion_logprobs(out.logprobs, 0, body.logprobs or 0),
            "finish_reason": finish_reason(out),
        }
        for i, out in enumerate(finals)
    ]
    per_prompt = [finals[p * n : (p + 1) * n] for p in range(len(prompts))]
    return maker.final("text_completion", choices, usage(*prompt_usage(per_prompt), finals))


async def _completion_prompts(body: CompletionRequest, serving: Serving) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt or any(len(p) == 0 for p in prompt):
        raise APIError(400, "prompt must not be empty", "prompt")
    if body.suffix is not None:
        if not all(isinstance(p, str) for p in prompt):
            raise APIError(400, "suffix goes with a text prompt, not token ids", "suffix")
        return [await serving.encode_fim(p, body.suffix) for p in prompt]
    prompts = [await serving.encode_text(p) if isinstance(p, str) else list(p) for p in prompt]
    if all(prompts):
        return prompts
    # text of no tokens (control characters the tokenizer drops): the model starts from its text's start,
    # as an unconditioned completion does
    bos = serving.tokenizer.bos_token_id
    return [p or ([bos] if bos is not None else p) for p in prompts]


async def _completion_events(
    streams: list[EngineStream], maker: ChunkMaker, echoes: list[str], n: int, num_logprobs: int | None,
    waiting: _Waiting,
) -> AsyncIterator[bytes]:
    yield SSE_PING  # at once: the stream is open while the prompt is read
    offsets = [len(e) for e in echoes]
    for i, echo in enumerate(echoes):
        if echo:
            yield sse_event(
                maker.chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
            )
    finals: list[RequestOutput] = [None] * len(streams)  # type: ignore[list-item]
    try:
        async with aclosing(waiting.ticking(streams)) as outputs:
            async for item in outputs:
                if isinstance(item, Tick):
                    yield waiting.event(streams, maker)
                    continue
                i, out = item
                want_logprobs = num_logprobs is not None and out.new_logprobs
                if out.delta_text or want_logprobs:
                    logprobs = completion_logprobs(out.new_logprobs, offsets[i], num_logprobs or 0)
                    offsets[i] += len(out.delta_text)
                    choice = {"index": i, "text": out.delta_text, "logprobs": logprobs, "finish_reason": None}
                    yield sse_event(maker.chunk([choice]))
                if out.finished:
                    finals[i] = out
                    choice = {"index": i, "text": "", "logprobs": None, "finish_reason": finish_reason(out)}
                    yield sse_event(maker.chunk([choice]))
    except (APIError, EngineDeadError) as e:
        yield sse_event(_stream_error(e))
        yield SSE_DONE
        return
    if maker.include_usage:
        per_prompt = [finals[p * n : (p + 1) * n] for p in range(len(finals) // n)]
        yield sse_event(maker.chunk([], usage(*prompt_usage(per_prompt), finals)))
    yield SSE_DONE


# --- shared -----------------------------------------------------------------------------------------
def _closer(streams: list[EngineStream]):
    async def close() -> None:
        for stream in streams:
            await stream.aclose()

    return close


# --- /v1/models -------------------------------------------------------------------------------------
def _model_object(name: str, created: float, context: int) -> dict:
    """OpenAI's model object with Anthropic's fields beside (``chat_bodies.Model``)."""
    return {
        "id": name,
        "object": "model",
        "created": int(created),
        "owned_by": "kvserve",
        "max_model_len": context,
        "type": "model",
        "display_name": name,
        "created_at": datetime.fromtimestamp(int(created), UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _card_object(card: ModelCard) -> dict:
    return _model_object(card.name, card.modified, card.context_length)


def _encoder_object(encoder) -> dict:
    return _model_object(encoder.name, encoder.path.stat().st_mtime, encoder.config.max_seq_length)


@router.get("/v1/models", response_model=None,
            responses=ok(chat_bodies.ModelList,
                         "The served model, and the embedding and rerank models beside it"))
async def list_models(request: Request) -> dict:
    data = [_card_object(slot.card) for slot in request.app.state.models.slots] \
        + [_encoder_object(e) for e in _encoders(request)]
    return {"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def _encoders(request: Request) -> list:
    state = request.app.state
    return [e for e in (getattr(state, "encoder", None), getattr(state, "reranker", None)) if e is not None]


@router.get(
    "/v1/models/{model:path}",
    response_model=None,
    responses=ok(chat_bodies.Model, "The model") | openai_errors(404),
)
async def get_model(model: str, request: Request) -> dict:
    for encoder in _encoders(request):
        if names(encoder, model):
            return _encoder_object(encoder)
    return _card_object(request.app.state.models.find(model).card)
