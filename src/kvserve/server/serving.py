"""The one bridge from HTTP handlers to the ``AsyncLLMEngine``: prompts in, ``RequestOutput`` streams out.

``Serving.start`` admits a request before the handler commits to a status code, so admission errors
(prompt too long, queue full, bad token ids) become proper 4xx responses instead of mid-stream
failures. An ``EngineStream`` that is closed early (client gone, handler cancelled) aborts its
request, which frees its KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from jinja2.exceptions import TemplateError

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, PromptProgress
from kvserve.engine.constraints import Constraint, compiled
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.api_errors import APIError, engine_error
from kvserve.server.engine_view import EngineView
from kvserve.server.metrics import RequestTracker, ServerMetrics
from kvserve.server.model_card import ModelCard
from kvserve.server.server_config import ServerConfig
from kvserve.server.streaming import Tick, cancel_on_disconnect, with_ticks
from kvserve.server.thinking import Thinking, thinking_for
from kvserve.server.tools import (
    Tool,
    ToolChoice,
    ToolUse,
    ToolUseError,
    WrittenCalls,
    messages_for_template,
    template_takes_tools,
)
from kvserve.server.tools.call_formats import CallFormat, call_format


def sampling_params(param_names: dict[str, str] | None = None, **kwargs: Any) -> SamplingParams:
    """``SamplingParams(**kwargs)`` with its ValueError turned into a 400. ``param_names`` maps our
    field names to the API's, so the message names what the client sent."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        for ours, theirs in (param_names or {}).items():
            if message.startswith(ours + " "):
                message = theirs + message[len(ours) :]
        raise APIError(400, message) from None


def system_turns_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with every system turn after the first message merged into the leading system prompt
    (one made if there is none), in order; None when there is no such turn. For chat templates that refuse
    a system turn anywhere but first: the text still reaches the model, at the cost of the prompt's cached
    prefix whenever such a turn changes."""
    later = [m for m in messages[1:] if m["role"] == "system"]
    if not later:
        return None
    head = [messages[0]] if messages and messages[0]["role"] == "system" else []
    text = "\n\n".join(m["content"] for m in head + later if m.get("content"))
    rest = [m for m in messages[len(head):] if m["role"] != "system"]
    return [{"role": "system", "content": text}, *rest]


class EngineStream:
    """One admitted engine request. Iterate it once; leaving the iteration early aborts the request."""

    def __init__(
        self, agen: AsyncIterator[RequestOutput], first: asyncio.Future, tracker: RequestTracker,
        progress: Callable[[], PromptProgress | None] = lambda: None, prompt_len: int = 0,
    ) -> None:
        self._agen = agen
        self._first = first
        self._tracker = tracker
        self._progress = progress
        self._prompt_len = prompt_len
        self._closed = False

    def progress(self) -> PromptProgress:
        """How far its prompt has been read (before the engine takes it in: nothing yet)."""
        return self._progress() or PromptProgress(self._prompt_len, 0, 0, time.perf_counter())

    def ticking(self, every: float) -> AsyncIterator[RequestOutput | Tick]:
        """Its outputs, and ``TICK`` whenever ``every`` seconds pass without one
        (``streaming.with_ticks``)."""
        return with_ticks(self.__aiter__(), every)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            out = await self._first
            self._tracker.observe(out)
            yield out
            async for out in self._agen:
                self._tracker.observe(out)
                yield out
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Aborts the request unless it finished. Not while another task is iterating the stream."""
        if self._closed:
            return
        self._closed = True
        if not self._first.done():
            self._first.cancel()  # cancels generate() at its wait: it aborts the request
            await asyncio.wait([self._first])
        elif not self._first.cancelled():
            self._first.exception()  # retrieved, so asyncio does not log it
        await self._agen.aclose()
        self._tracker.close()


class Serving:
    """One loaded model: its engine, its card, and the view ``/metrics`` and the cache routes read it through
    (``view``: the engine's own by default; behind replicas, their sum)."""

    def __init__(
        self, async_engine: AsyncLLMEngine, card: ModelCard, metrics: ServerMetrics, config: ServerConfig,
        view: EngineView | None = None,
    ) -> None:
        self.async_engine = async_engine
        self.config = config
        self.card = card
        self.metrics = metrics
        self.view = view or EngineView(async_engine)
        self.written = WrittenCalls()  # answers with calls, rendered as written when a client sends them back

    @property
    def max_model_len(self) -> int:
        return self.async_engine.engine.max_model_len

    @functools.cached_property
    def call_format(self) -> CallFormat:
        """How the model's family writes a tool call (``call_formats``), read from its chat template."""
        return call_format(self.async_engine.engine.tokenizer)

    @property
    def vocab_size(self) -> int:
        """The model's logits: the token ids a request may name."""
        return self.async_engine.engine.model_config.vocab_size

    @property
    def hidden_size(self) -> int:
        """Its embeddings' dimensions (``/v1/embeddings`` with a chat model)."""
        return getattr(self.async_engine.engine.model_config, "hidden_size", 0)

    @property
    def features(self) -> frozenset[str]:
        """What the served model can do beyond text in and out: "fim" (fill-in-the-middle tokens),
        "thinking" (a thought it writes first). None of them without a tokenizer (token ids only)."""
        tokenizer = self.async_engine.engine.tokenizer
        if tokenizer is None:
            return frozenset()
        return frozenset(name for name, has in (("fim", tokenizer.fim is not None),
                                                ("thinking", tokenizer.thinks))
                         if has)

    @property
    def tokenizer(self):
        tokenizer = self.async_engine.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompts as token ids (/v1/completions)")
        return tokenizer

    def tool_use(self, tools: list[Tool], choice: ToolChoice, answer: Callable[[], Constraint | None],
                 answer_param: str) -> ToolUse:
        """The one question a dialect asks of its request's tools (``tools.ToolUse.decide``) in this model
        family's form of a call; what cannot be used is a 400 naming its field."""
        try:
            return ToolUse.decide(tools, choice, answer, answer_param, self.call_format, self.written)
        except ToolUseError as e:
            raise APIError(400, str(e), e.param) from None

    # --- prompts --------------------------------------------------------------------------------------
    async def encode_chat(
        self, messages: list[dict[str, Any]], add_special: bool = True, tools: list[Tool] | None = None,
        template_variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The messages through the model's chat template, ending with the assistant's turn; with
        ``tools``, they and the tool turns of ``messages`` as ``tools.messages_for_template`` puts them;
        ``template_variables`` (``enable_thinking``, ...) beside them."""
        tokenizer = self.tokenizer
        messages, variables = messages_for_template(
            messages, tools or [], template_takes_tools(tokenizer.chat_template), self.written
        )
        variables = {**(template_variables or {}), **variables}
        self.check_size(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
                        + sum(len(t.description) + len(json.dumps(t.parameters)) for t in tools or []),
                        "messages")

        def encode() -> list[int]:
            return tokenizer.encode_chat(
                messages,
                add_special=add_special,
                special_tokens_in_content=self.config.special_tokens_in_messages,
                variables=variables,
            )

        try:
            try:
                return await asyncio.to_thread(encode)
            except TemplateError:
                merged = system_turns_first(messages)
                if merged is None:
                    raise
                messages = merged  # a template that takes no system turn mid-conversation (Gemma's, ...)
                return await asyncio.to_thread(encode)
        except TemplateError as e:
            raise APIError(400, f"the model's chat template rejected the messages: {e}", "messages") from None
        except ValueError as e:  # text that is not valid Unicode, a special token the template mangles
            raise APIError(400, str(e), "messages") from None

    def check_size(self, characters: int, param: str | None = None) -> None:
        """Refuses a prompt of ``characters`` that cannot fit the context whatever its tokens (each stands
        for at most ``max_token_bytes``), before any work on it."""
        least = characters // self.tokenizer.max_token_bytes
        if least >= self.max_model_len:
            raise APIError(400,
                           f"the prompt is at least {least:,} tokens ({characters:,} characters) but the "
                                f"context limit is {self.max_model_len} tokens; shorten it", param,
                           "context_length_exceeded")

    async def encode_text(self, text: str, add_special: bool = True, param: str = "prompt") -> list[int]:
        tokenizer = self.tokenizer
        self.check_size(len(text), param)
        try:
            return await asyncio.to_thread(tokenizer.encode, text, add_special)
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    async def encode_fim(self, prefix: str, suffix: str, extra: list[tuple[str, str]] = (), middle: str = "",
                         param: str = "suffix") -> list[int]:
        """A fill-in-the-middle prompt (``Tokenizer.encode_fim``); a 400 for a model without FIM tokens."""
        tokenizer = self.tokenizer
        try:
            return await asyncio.to_thread(tokenizer.encode_fim, prefix, suffix, list(extra), middle)
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    def thinking_switch(self, asked: bool | None) -> bool | None:
        """A request's thinking switch, off where the server turns thinking off (--reasoning-budget 0)."""
        return False if asked is None and self.config.reasoning_budget == 0 else asked

    def thinking(self, prompt: list[int], enable: bool | None, budget: int | None = None) -> Thinking | None:
        """The request's thought (``server.thinking``); ``budget``: the request's, else the server's."""
        tokenizer = self.async_engine.engine.tokenizer
        if tokenizer is None:
            return None
        return thinking_for(tokenizer, prompt, enable,
                            self.config.reasoning_budget if budget is None else budget)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    # --- generation -----------------------------------------------------------------------------------
    async def start(
        self, prompt: list[int], params: SamplingParams, request_id: str, param: str | None = None,
        prepared: Any = None,
    ) -> EngineStream:
        """Admits the request or raises ``APIError``. ``param`` names the prompt field in errors;
        ``prepared``: the engine's ``prepare`` of it (``start_all``), its grammar compiled already."""
        if prepared is None:
            await self._compile_grammar(params.constraint)
        agen = self.async_engine.generate(prompt, params, request_id, prepared=prepared)
        first = asyncio.ensure_future(agen.__anext__())
        # generate() calls add_request before its first await, and a new task runs before the task
        # that created it resumes from sleep(0): after one turn, admission has happened or failed
        try:
            await asyncio.sleep(0)
        except BaseException:  # cancelled right here: do not leave the request running unowned
            first.cancel()
            await asyncio.wait([first])
            raise
        if first.done() and not first.cancelled() and first.exception() is not None:
            error = first.exception()
            mapped = engine_error(error, param) if isinstance(error, Exception) else None
            if mapped is None:
                raise error
            raise mapped from None
        engine = self.async_engine
        return EngineStream(agen, first, self.metrics.tracker(self.card.name),
                            functools.partial(engine.prompt_progress, request_id), len(prompt))

    async def _compile_grammar(self, constraint: Constraint | None) -> None:
        """A request's grammar, compiled in a worker thread (llguidance releases the GIL), never on the
        event loop; the engine then finds it in ``compiled``'s cache."""
        grammar_tokenizer = getattr(self.async_engine.engine, "grammar_tokenizer", None)
        if constraint is not None and grammar_tokenizer is not None:
            try:
                await asyncio.to_thread(compiled, constraint, grammar_tokenizer)
            except ValueError as e:
                raise APIError(400, str(e)) from None

    async def start_all(
        self, requests: list[tuple[list[int], SamplingParams, str]], param: str | None = None
    ) -> list[EngineStream]:
        """Admits every request or none: on a failure the ones already admitted are aborted. Several are
        each prepared (tokenized and checked, once) and the queue's room checked for all of them before
        any is admitted, so a refused request never holds places that other clients' requests are then
        refused for."""
        prepared: list[Any] = [None] * len(requests)
        if len(requests) > 1:
            for constraint in dict.fromkeys(p.constraint for _, p, _ in requests):  # n choices share one
                await self._compile_grammar(constraint)
            try:
                prepared = [self.async_engine.prepare(prompt, params, request_id)
                            for prompt, params, request_id in requests]
                self.async_engine.check_capacity(len(requests))
            except Exception as e:
                mapped = engine_error(e, param)
                if mapped is None:
                    raise
                raise mapped from None
        streams: list[EngineStream] = []
        try:
            for (prompt, params, request_id), ready in zip(requests, prepared, strict=True):
                streams.append(await self.start(prompt, params, request_id, param, ready))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return streams


async def collect_finals(request: Request, streams: list[EngineStream]) -> list[RequestOutput]:
    """Each stream's final output, in order, for answers sent as one object; the requests are
    cancelled if the client goes away, and the streams closed either way."""

    async def finals_in_order() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                if out.finished:
                    finals[i] = out
        return finals  # type: ignore[return-value]

    try:
        return await cancel_on_disconnect(request, finals_in_order())
    # ended mid-answer (the model unloaded, the server stopping): a 503, not a 500
    except EngineDeadError as e:
        raise engine_error(e) from None
    finally:
        for stream in streams:
            await stream.aclose()


async def merge(streams: list[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they come. Closing the merge closes every stream it
    started; use it under ``contextlib.aclosing`` so that happens at once, not at garbage collection."""
    if len(streams) == 1:
        async with aclosing(streams[0].__aiter__()) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: EngineStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
            queue.put_nowait((index, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
