"""Several models behind one server, loaded when asked for: Ollama's scheduler, in the server.

The first model (``kvserve serve MODEL ...``'s first) is the default: loaded at start (so a bad file is said
at once) and answering requests that name no model. After that every model is a slot alike: loaded by the
first request that names it (the requests behind it wait for that one load), unloaded when idle for its
``keep_alive`` (Ollama's forms: ``"5m"``, seconds, 0 = after the answer, negative = never; default
``--keep-alive``), and evicted least recently used first when a new one would not fit the memory budget
(``--max-memory``) or the count (``--max-loaded-models``). A model is sized before it loads by the planner's
engine total less the runtime both share; one that cannot fit even alone is a 503 with those numbers, never
an out-of-memory kill. Only a model there is no loader for (the replicas' engine) is never unloaded.

``/metrics``, ``/v1/kvserve/cache``, the web page and ``kvserve top`` read every loaded model through its
``Serving``'s view; ``states`` and ``events`` tell them which models are loaded and what loaded or unloaded.

Idle means no stream open on its engine and no request named it for GRACE seconds (a request tokenizes
before its stream opens). Each loaded model keeps its own engine thread, KV pool and prefix cache: engines
run side by side, so two busy models share the CPU as two processes would.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvserve.host_memory import release_freed_memory
from kvserve.server.api_errors import APIError
from kvserve.server.model_card import ModelCard
from kvserve.server.serving import Serving

log = logging.getLogger(__name__)

EVENTS = 20  # load and unload events kept for the web page and kvserve top
GRACE = 2.0  # seconds after a request names a model during which it counts as busy
TICK = 0.25  # seconds between two looks for expired models
WAIT_FOR_ROOM = 600.0  # seconds a load may wait for busy models to become idle
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | float | None, default: float | None) -> float | None:
    """Ollama's keep_alive as seconds: None (never unload) for a negative value, ``default`` for None."""
    if value is None:
        return default
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?[0-9]+(\.[0-9]+)?", text):
            seconds = float(text)
        else:
            sign = -1.0 if text.startswith("-") else 1.0
            seconds = sign * sum(
                float(n) * _UNITS[u] for n, u in re.findall(r"([0-9.]+)(ns|us|µs|ms|s|m|h)", text))
    else:
        seconds = float(value)
    return None if seconds < 0 else seconds


@dataclass(slots=True)
class Slot:
    name: str  # what clients send
    source: str  # what load_model reads: a registry name, a file, a folder
    planned: int  # bytes the planner says it takes, beside the runtime all share
    card: ModelCard  # from its header until it loads, then its engine's
    serving: Serving | None = None
    pinned: bool = False  # no loader could load it again: never unloaded
    last_used: float = 0.0  # time.monotonic() of the last request naming it
    keep_alive: float | None = None  # seconds idle before unloading; None: never
    loading: asyncio.Future | None = None
    leases: int = 0  # handlers holding it between engine streams (``ServedModels.lease``)

    def matches(self, name: str | None) -> bool:
        return self.card.matches(name)  # the card holds this slot's name

    def expires_at(self) -> float | None:
        """Unix time it will be unloaded if no request names it again; None: never."""
        if self.pinned or self.keep_alive is None:
            return None
        return time.time() + max(0.0, self.last_used + self.keep_alive - time.monotonic())


@dataclass(slots=True)
class ModelEvent:
    """A load or unload, for the web page and ``kvserve top``."""

    time: float  # Unix time
    model: str
    event: str  # loaded, unloaded, load_failed
    detail: str  # "in 2.1 s", the unload's reason, the failure


@dataclass(slots=True)
class ModelState:
    """One model as the web page and ``kvserve top`` list it."""

    name: str
    state: str  # loaded, loading, unloaded
    planned_bytes: int  # what the planner says it takes (0: not planned, a lone model)
    expires_at: float | None  # Unix time it unloads if idle; None: never, or not loaded


class ServedModels:
    """The slots, and the rule for loading and unloading them. ``first``: the default model, loaded, read
    from ``first_source`` (planned at ``first_planned`` bytes); ``others``: name -> (source, planned bytes,
    card); ``load(source, name)`` makes a Serving (in a worker thread: it takes seconds)."""

    def __init__(self, first: Serving, others: dict[str, tuple[str, int, ModelCard]] | None = None,
                 load: Callable[[str, str], Serving] | None = None, budget: int | None = None,
                 max_loaded: int = 0, keep_alive: float | None = None, first_source: str | None = None,
                 first_planned: int = 0) -> None:
        self.slots = [Slot(first.card.name, first_source or str(first.card.path), first_planned, first.card,
                           first, pinned=load is None, last_used=time.monotonic())]
        for name, (source, planned, card) in (others or {}).items():
            self.slots.append(Slot(name, source, planned, card))
        self.load, self.budget, self.max_loaded, self.keep_alive = load, budget, max_loaded, keep_alive
        self.events: deque[ModelEvent] = deque(maxlen=EVENTS)
        self.metrics = getattr(first, "metrics", None)
        if self.metrics is not None:
            for slot in self.slots:
                self.metrics.model_loaded.labels(model=slot.name).set(slot.serving is not None)
        self._room = asyncio.Lock()  # one load (and its evictions) at a time
        self._reaper: asyncio.Task | None = None
        self._releasing = 0  # planned bytes of models unloading now: not free until their engine is collected

    # --- asking for a model -------------------------------------------------------------------------------
    def find(self, name: str | None) -> Slot:
        """The slot a request's model names; no name: the default (the first)."""
        if name is None:
            return self.slots[0]
        for slot in self.slots:
            if slot.matches(name):
                return slot
        served = ", ".join(f"'{s.name}'" for s in self.slots)
        raise APIError(404, f"model '{name}' not found; this server serves {served}", "model",
                       "model_not_found")

    async def serving(self, name: str | None, keep_alive: str | float | None = None) -> Serving:
        """The named model's Serving, loaded first if it is not (404 for a name this server does not
        serve). ``keep_alive`` (Ollama's) sets how long it stays once idle."""
        return (await self._ready(name, keep_alive)).serving

    async def _ready(self, name: str | None, keep_alive: str | float | None) -> Slot:
        """The named model's slot, loaded."""
        slot = self.find(name)
        self._touch(slot, keep_alive)
        while slot.serving is None:
            if slot.loading is None:
                slot.loading = asyncio.ensure_future(self._load(slot))
            try:
                await asyncio.shield(slot.loading)
            finally:
                if slot.loading is not None and slot.loading.done():
                    slot.loading = None
        self._touch(slot, keep_alive)
        return slot

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None, keep_alive: str | float | None = None) -> AsyncIterator[Serving]:
        """The named model's Serving, kept loaded until the block ends (a handler that runs several engine
        streams one after another: no stream is open between them, yet the model is in use)."""
        slot = await self._ready(name, keep_alive)
        slot.leases += 1
        try:
            yield slot.serving
        finally:
            slot.leases -= 1
            slot.last_used = time.monotonic()

    def _touch(self, slot: Slot, keep_alive: str | float | None) -> None:
        """Each request sets the model's expiry anew, from its keep_alive or the server's (as Ollama)."""
        slot.last_used = time.monotonic()
        slot.keep_alive = keep_alive_seconds(keep_alive, self.keep_alive)

    async def release(self, name: str | None) -> bool:
        """Ollama's empty request with keep_alive 0: unload the model now unless a stream is open on it.
        Returns whether it is unloaded."""
        slot = self.find(name)
        if slot.pinned or slot.serving is not None and (
            slot.serving.async_engine.num_open_streams or slot.leases):
            return slot.serving is None
        await self.unload(slot, "asked")
        return True

    async def _load(self, slot: Slot) -> None:
        async with self._room:
            await self._make_room(slot)
            log.info("loading model '%s' (%s)", slot.name, slot.source)
            started = time.perf_counter()
            try:
                slot.serving = await asyncio.to_thread(self.load, slot.source, slot.name)
                slot.card = slot.serving.card
                slot.last_used = time.monotonic()  # the requests waiting for it are about to use it
                if self.metrics is not None:
                    self.metrics.model_loads.labels(model=slot.name).inc()
                    self.metrics.model_loaded.labels(model=slot.name).set(1)
            except Exception as e:
                log.exception("model '%s' did not load", slot.name)
                self._event(slot, "load_failed", str(e))
                raise APIError(503, f"model '{slot.name}' could not be loaded: {e}", "model",
                               "load_failed") from None
            seconds = time.perf_counter() - started
            log.info("loaded model '%s' in %.1f s", slot.name, seconds)
            self._event(slot, "loaded", f"in {seconds:.1f} s")

    async def _make_room(self, slot: Slot) -> None:
        """Unload idle models, least recently used first, until ``slot`` fits; wait for busy ones."""
        if self.budget is not None and slot.planned > self.budget:
            raise APIError(
                503,
                f"model '{slot.name}' needs {slot.planned / 2**20:.0f} MiB (kvserve plan), more "
                f"than "
                f"this server's memory budget of {self.budget / 2**20:.0f} MiB (--max-memory)",
                "model",
                "insufficient_memory",
            )
        deadline = time.monotonic() + WAIT_FOR_ROOM
        while not self._fits(slot):
            idle = sorted((s for s in self.loaded() if not s.pinned and not self.busy(s)),
                          key=lambda s: s.last_used)
            if idle:
                await self.unload(idle[0], "evicted", f"to make room for '{slot.name}'")
                continue
            if time.monotonic() > deadline:
                raise APIError(503,
                               f"model '{slot.name}' waited {WAIT_FOR_ROOM:.0f} s for a loaded model to "
                               f"become "
                                    "idle", "model", "insufficient_memory")
            await asyncio.sleep(TICK)

    def _fits(self, slot: Slot) -> bool:
        loaded = [s for s in self.loaded() if s is not slot]
        if self.max_loaded and len(loaded) + 1 > self.max_loaded:
            return False
        return (
            self.budget is None
            or sum(s.planned for s in loaded) + self._releasing + slot.planned <= self.budget
        )

    # --- what is loaded -----------------------------------------------------------------------------------
    def loaded(self) -> list[Slot]:
        return [s for s in self.slots if s.serving is not None]

    def shown(self, name: str | None) -> Serving:
        """The loaded model a view of the cache shows: the one named, else the default if loaded, else the
        most recently used (409 when the one named, or every one, is not loaded). Never loads a model."""
        if name is not None:
            slot = self.find(name)
            if slot.serving is None:
                raise APIError(409, f"model '{slot.name}' is not loaded (GET /api/ps lists those that are)",
                               "model", "model_not_loaded")
            return slot.serving
        loaded = sorted(self.loaded(), key=lambda s: (s is not self.slots[0], -s.last_used))
        if not loaded:
            raise APIError(409, "no model is loaded; a request naming one loads it", "model",
                           "model_not_loaded")
        return loaded[0].serving

    def views(self) -> list[tuple[str, object]]:
        """(name, its ``EngineView``) of each loaded model: what ``/metrics`` reads."""
        # read from a worker thread (a scrape) while the event loop may unload: each slot's serving read once
        return [(s.name, serving.view) for s in self.slots if (serving := s.serving) is not None]

    def states(self) -> list[ModelState]:
        return [ModelState(s.name, "loaded" if s.serving is not None else "loading" if s.loading is not None
                           else "unloaded", s.planned, s.expires_at() if s.serving is not None else None)
                for s in self.slots]

    def recent(self) -> list[ModelEvent]:
        return list(self.events)

    def _event(self, slot: Slot, event: str, detail: str) -> None:
        self.events.append(ModelEvent(time.time(), slot.name, event, detail))

    def end_streams(self, reason: str) -> None:
        """A stopping server ends every loaded model's open streams with ``reason``."""
        for slot in self.loaded():
            slot.serving.async_engine.end_streams(reason)

    def busy(self, slot: Slot) -> bool:
        if slot.serving is None:
            return False
        engine = slot.serving.async_engine
        return time.monotonic() - slot.last_used < GRACE or engine.num_open_streams > 0 or slot.leases > 0

    async def unload(self, slot: Slot, reason: str, why: str = "") -> None:
        """reason: keep_alive, evicted, asked or stopping (the metrics' label; stopping unloads even a
        pinned model); why: the log's words."""
        if slot.serving is None or slot.pinned and reason != "stopping":
            return
        serving, slot.serving = slot.serving, None
        log.info("unloading model '%s' (%s) %s", slot.name, reason, why)
        self._event(slot, "unloaded", f"{reason} {why}".strip())
        if self.metrics is not None:
            self.metrics.model_unloads.labels(model=slot.name, reason=reason).inc()
            self.metrics.model_loaded.labels(model=slot.name).set(0)
        self._releasing += slot.planned
        try:
            # waits for the engine's step to end (stopping the server: 5 s at most), then frees it
            await asyncio.to_thread(serving.async_engine.shutdown,
                                    f"model '{slot.name}' was unloaded ({reason}); "
                                    "retry", 5 if reason == "stopping" else None)
            del serving
            await asyncio.to_thread(_collect)
        finally:
            self._releasing -= slot.planned

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            for slot in self.loaded():
                if slot.pinned or slot.keep_alive is None or self.busy(slot):
                    continue
                if now - slot.last_used >= slot.keep_alive:
                    try:
                        await self.unload(slot, "keep_alive", f"after {slot.keep_alive:g} s idle")
                    except Exception:  # the reaper goes on: a model that failed to unload is tried no more
                        log.exception("model '%s' did not unload", slot.name)

    def start(self) -> None:
        """Begins unloading expired models (from the server's event loop)."""
        if self._reaper is None and self.load is not None:
            self._reaper = asyncio.ensure_future(self._reap())

    async def stop(self) -> None:
        """Stops the reaper and every engine."""
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in self.loaded():
            await self.unload(slot, "stopping")


def _collect() -> None:
    """An engine is freed by the cyclic collector (its objects refer to each other), whose oldest generation
    may not run for a long while: collect now, then hand the C heap's freed pages back."""
    gc.collect()
    release_freed_memory()

async def served(request, name: str | None, keep_alive: str | float | None = None) -> Serving:
    """The Serving of the model a request names (loaded if need be): each API's handlers start here."""
    return await request.app.state.models.serving(name, keep_alive)
