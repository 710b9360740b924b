"""``AsyncLLMEngine``: the engine loop on a background thread, results streamed to asyncio callers.

    caller (event loop)                        engine thread
    generate(): validate, enqueue "add"  --->  drain adds/aborts, step(), drain, step() ...
                <- asyncio.Queue <-----------  one RequestOutput per step, via call_soon_threadsafe

Callers never wait for a step: requests are validated on the caller's side (errors raise at once)
and handed over through a queue that the engine thread drains between steps, together with aborts.
A caller that stops iterating (client disconnect, cancellation) aborts its request, which frees its
KV blocks before the next step; an abort from elsewhere ends the caller's stream with an "abort".
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """A prompt being read: ``total`` tokens, ``cached`` of them found in the prefix cache, ``computed`` of
    them with K/V in the cache so far (the cached ones included); ``arrival`` on ``time.perf_counter``."""

    total: int
    cached: int
    computed: int
    arrival: float


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests cannot be served."""


class EngineShutdownError(EngineDeadError):
    """The server is shutting down: running requests end now, new ones are refused."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.lock = threading.Lock()  # held by the engine thread while it changes engine state
        self._pending: deque[tuple[str, Request | str]] = deque()  # ("add", request) / ("abort", id)
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        prepared: Request | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one ``RequestOutput`` per step that produced a token; the last has ``finished``.
        Invalid requests raise (ValueError, PromptTooLongError, QueueFullError) before any await.
        ``prepared``: the request ``prepare`` made (then the other arguments are not read again)."""
        self._raise_if_dead()
        request = prepared or self.engine.make_request(prompt, params, request_id, cache_salt)
        queue: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:  # against _fail_all: a stream registered here is failed there, or sees it
            self._raise_if_dead()
            self._admit(request)
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
            self._pending.append(("add", request))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, EngineShutdownError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def prepare(self, prompt: str | list[int], params: SamplingParams | None = None,
                request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """The request ``generate`` would admit, tokenized and checked (``LLMEngine.make_request``; safe
        from any thread): a request of many prompts or choices prepares every one, so each is checked
        once and all before any is admitted. Raises ValueError or PromptTooLongError."""
        return self.engine.make_request(prompt, params, request_id, cache_salt)

    def _raise_if_dead(self) -> None:
        if isinstance(self.dead_error, EngineShutdownError):
            raise EngineShutdownError(str(self.dead_error))
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error}")

    def _admit(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        self.engine.scheduler.check_capacity(num_pending=self.num_pending_adds)

    def check_capacity(self, count: int) -> None:
        """Raise QueueFullError now if ``count`` more requests could not all be admitted (so a request
        of many prompts or choices is refused before any of them takes a place in the queue)."""
        self.engine.scheduler.check_capacity(num_pending=self.num_pending_adds, count=count)

    @property
    def num_pending_adds(self) -> int:
        """Requests accepted by ``generate`` that the engine thread has not taken in yet."""
        return sum(1 for kind, _ in list(self._pending) if kind == "add")

    @property
    def num_open_streams(self) -> int:
        """``generate`` calls under way (their callers still reading): 0 when the engine is idle."""
        return len(self._streams)

    def prompt_progress(self, request_id: str) -> PromptProgress | None:
        """How far the engine has read a request's prompt, from any thread (plain reads of counters the engine
        thread moves forward); None once it is finished or before the engine took it in."""
        request = self.engine.scheduler.requests.get(request_id)
        if request is None:
            return None
        total = request.num_prompt_tokens
        cached = max(request.num_cached_tokens, 0)
        return PromptProgress(total, cached, min(request.num_computed_tokens, total),
                              request.metrics.arrival_time)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream (if still read) ends with finish_reason "abort"."""
        self._pending.append(("abort", request_id))
        self._wakeup.set()

    # --- the engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            try:
                with self.lock:
                    self._drain_pending()
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
            except BaseException as e:  # a failed forward is handled in step(); this is the engine's own bug
                log.exception("the engine loop failed; every request fails")
                self._fail_all(e)
                return
            if not busy:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            for output in outputs:
                self._deliver(output)

    def _drain_pending(self) -> None:
        while self._pending:
            kind, item = self._pending.popleft()
            if kind == "add":
                try:
                    self.engine.add_prepared(item)
                except Exception as e:  # noqa: BLE001 (a race the caller-side checks could not see: its request fails alone)
                    self._deliver_error(item.request_id, e)
            else:
                output = self.engine.abort_request(item)
                if output is not None:
                    self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        with self._streams_lock:
            target = self._streams.get(output.request_id)
            if target is None:
                return
            if output.finished:
                self._streams.pop(output.request_id, None)
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, output)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._streams_lock:
            target = self._streams.pop(request_id, None)
        if target is not None:
            try:
                target[0].call_soon_threadsafe(target[1].put_nowait, error)
            except RuntimeError:
                pass

    def _fail_all(self, error: BaseException) -> None:
        """Every waiter gets ``error`` at once; later ``generate`` calls raise EngineDeadError."""
        with self._streams_lock:
            self.dead_error = error
            streams, self._streams = self._streams, {}
        for loop, queue in streams.values():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, error)
            except RuntimeError:  # the caller's loop is closed
                pass
        with self.lock:
            for request_id in streams:
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    log.exception("could not abort %s after the engine failed", request_id)

    def end_streams(self, reason: str) -> None:
        """Graceful shutdown, from any thread (a signal handler included): every caller's stream ends
        now with ``EngineShutdownError`` (the server turns it into a final error event), and later
        ``generate`` calls raise it. The engine thread aborts the requests and frees their blocks."""
        error = EngineShutdownError(reason)
        with self._streams_lock:
            if self.dead_error is None:
                self.dead_error = error
            streams, self._streams = self._streams, {}
        for request_id, (loop, queue) in streams.items():
            self.abort(request_id)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, error)
            except RuntimeError:  # the caller's loop is closed
                pass

    def shutdown(self, reason: str = "the engine was stopped; retry", timeout: float | None = 5) -> None:
        """Stops the engine thread, waiting ``timeout`` seconds for its step to end (None: as long as it
        takes). Streams still open end with ``EngineShutdownError(reason)`` and later ``generate`` calls
        raise it (unless the engine had already ended them), so that nobody waits on an engine that no
        longer steps."""
        self.end_streams(reason)
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.engine.close()  # the disk tier's queued blocks reach the disk
