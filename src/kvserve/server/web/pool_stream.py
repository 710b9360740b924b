"""The live pool stream behind ``/v1/kvserve/cache/stream``: one sampler for every subscriber.

    sampler task (while anyone watches)          subscribers (one per open page)
    every INTERVAL: PoolView.frame() in a  --->  latest encoded frame + version; each waits for a
    worker thread, encoded once                  version it has not sent yet

However many pages watch, the engine lock is taken once per interval and each frame is encoded once.
A slow subscriber skips frames instead of queueing them, so it costs no memory. The sampler stops
when the last subscriber leaves, and ends every stream when the engine stops (a server shutting down
then closes them within its graceful timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from kvserve.server.web.pool_view import PoolView

log = logging.getLogger(__name__)

INTERVAL = 0.25  # seconds between frames: live to a person, and a few lock takes a second for the engine


class PoolStream:
    """``models()``: (the server's models' states, its recent load and unload events), read on the event
    loop for each frame."""

    def __init__(self, view: PoolView, models: Callable[[], tuple[list, list]] = lambda: ([], []),
                 interval: float = INTERVAL) -> None:
        self.view = view
        self.models = models
        self.interval = interval
        self._frame = b""
        self._version = 0
        self._ended = False  # the engine stopped: no more frames will come
        self._changed = asyncio.Condition()
        self._subscribers = 0
        self._sampler: asyncio.Task | None = None

    async def frames(self, max_frames: int | None = None) -> AsyncIterator[bytes]:
        """Encoded frames (JSON), each taken after the call; a subscriber that fell behind gets the
        newest."""
        self._subscribers += 1
        seen = self._version  # every frame sent is taken after the subscriber came
        if self._sampler is None or self._sampler.done():
            self._ended = False
            self._sampler = asyncio.ensure_future(self._sample())
        sent = 0
        try:
            while max_frames is None or sent < max_frames:
                async with self._changed:
                    while self._version == seen and not self._ended:
                        await self._changed.wait()
                    if self._version == seen:
                        return
                    frame, seen = self._frame, self._version
                yield frame
                sent += 1
        finally:
            self._subscribers -= 1

    def _take(self, models: tuple[list, list]) -> tuple[bytes, bool]:
        """(the frame encoded, whether the engine runs), in a worker thread: the lock waits for a step."""
        frame = self.view.frame()
        frame.models, frame.model_events = models
        return frame.encode(), frame.engine_alive

    async def _sample(self) -> None:
        try:
            while self._subscribers:
                encoded, alive = await asyncio.to_thread(self._take, self.models())
                async with self._changed:
                    self._frame, self._version = encoded, self._version + 1
                    self._ended = not alive
                    self._changed.notify_all()
                if self._ended:
                    return
                await asyncio.sleep(self.interval)
        except Exception:  # a bug: the streams end (the page reconnects) rather than hang
            log.exception("the KV pool view failed")
        finally:
            async with self._changed:
                self._ended = True
                self._changed.notify_all()
