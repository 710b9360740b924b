"""``AsyncLLMEngine``: the engine loop on a background thread, results streamed to asyncio callers.

    caller (event loop)                     engine thread
    generate() -> add_request  --lock-->    step() ... step() ...
               <- asyncio.Queue <--------   RequestOutput per step, via call_soon_threadsafe

A caller that stops iterating (client disconnect, cancellation) aborts its request, which frees
its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests cannot be served."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.lock = threading.Lock()  # guards every engine call: step, add, abort
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
    ) -> AsyncIterator[RequestOutput]:
        """Yields one ``RequestOutput`` per step that produced a token; the last has ``finished``."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error}")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self.lock:
            request = self.engine.add_request(prompt, params, request_id, cache_salt)
            self._streams[request.request_id] = (loop, queue)
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _loop(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                with self.lock:
                    outputs = self.engine.step()
            except BaseException as e:  # keep serving nothing rather than hanging every caller
                log.exception("engine step failed")
                self.dead_error = e
                self._fail_all(e)
                return
            for output in outputs:
                target = self._streams.get(output.request_id)
                if target is None:
                    continue
                loop, queue = target
                if output.finished:
                    self._streams.pop(output.request_id, None)
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, output)
                except RuntimeError:  # the caller's loop is closed
                    pass

    def _fail_all(self, error: BaseException) -> None:
        with self.lock:
            for request_id, (loop, queue) in list(self._streams.items()):
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, error)
                except RuntimeError:
                    pass
                self.engine.abort_request(request_id)
            self._streams.clear()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=5)
