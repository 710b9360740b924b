"""The ingress side of ``ray_serve``: ``build_app``'s routes over a ``RemoteEngine`` that sends each
request, as token ids, through the engine deployment's handle (so through ``KVPrefixRouter``).

The routes read little of an engine besides ``generate``: its tokenizer, context length and model
config, which a replica describes once when the ingress starts. What they read for ``/metrics`` and
``/v1/kvserve/cache`` comes from every replica at once (``ReplicasView``), summed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import ray

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import PromptTooLongError
from kvserve.server.api_errors import APIError
from kvserve.server.engine_view import EngineSnapshot
from kvserve.server.server_config import ServerConfig
from kvserve.tokenizer import Tokenizer

SERVED_BY_KEPT = 4096  # request ids remembered with their replica (/v1/kvserve/replicas)
SNAPSHOT_TIMEOUT_S = 10.0  # a replica's snapshot waits for its engine's step to end


class ReplicaRefusal(Exception):
    """An ``APIError`` raised on a replica, as it crosses to the ingress: the arguments only, since an
    exception whose constructor differs from its ``args`` does not unpickle there."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None) -> None:
        super().__init__(status, message, param, code)

    @classmethod
    def from_api_error(cls, e: APIError) -> ReplicaRefusal:
        return cls(e.status, e.message, e.param, e.code)

    def to_api_error(self) -> APIError:
        return APIError(*self.args)


@dataclass(slots=True)
class ReplicaFacts:
    """What the routes read of ``AsyncLLMEngine.engine``, as a replica described it."""

    tokenizer: Tokenizer | None
    max_model_len: int
    model_config: Any
    shifts_context: bool = False

    def check_prompt(self, prompt: list[int]) -> None:
        """What the replicas' admission would refuse for any replica (an empty prompt, one too long for
        the context where it is not shifted), refused here: a 400 before a stream starts. The replica
        still checks the rest (its queue) when it admits the request."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_model_len and not self.shifts_context:
            raise PromptTooLongError(
                f"the prompt is {len(prompt)} tokens but the context limit is {self.max_model_len} "
                "(room is needed for at least one new token)", len(prompt), self.max_model_len)


@dataclass(slots=True)
class RemoteRequest:
    """A request checked here (``RemoteEngine.prepare``), sent to a replica when it is generated."""

    prompt: list[int]
    params: SamplingParams
    request_id: str | None


class RemoteEngine:
    """The part of ``AsyncLLMEngine`` the routes use (``Serving``), over the engine deployment's handle.
    ``served_by`` maps the latest requests' ids to the replica that served them."""

    serves_replicas = True  # routes that show one engine's internals (the live pool) answer 501

    def __init__(self, handle, facts: ReplicaFacts) -> None:
        self.handle = handle
        self.engine = facts
        self.lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self.num_pending_adds = 0
        self.served_by: OrderedDict[str, str] = OrderedDict()

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        prepared: RemoteRequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLMEngine.generate``, but admission errors arrive with the first output, not before:
        the replica admits the request. A replica that dies mid-request ends it with a 503."""
        # before the first await: admission errors reach start() as a 400
        request = prepared or self.prepare(prompt, params, request_id, cache_salt)
        stream = self.handle.options(stream=True).generate.remote(request.prompt, request.params,
                                                                  request.request_id)
        finished = False
        try:
            async for replica_id, out in stream:
                finished = out.finished
                self._remember(out.request_id, replica_id)
                yield out
        except ray.exceptions.RayActorError:
            raise APIError(
                503, "the replica serving this request stopped; retry", code="replica_unavailable"
            ) from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ReplicaRefusal):  # admission errors, and an engine that stopped
                raise e.cause.to_api_error() from None
            raise
        finally:
            if not finished:
                stream.cancel()  # the replica's generate is cancelled: it aborts the request

    def prepare(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                cache_salt: str | None = None) -> RemoteRequest:
        """As ``AsyncLLMEngine.prepare``: what any replica would refuse, refused here (``ReplicaFacts``)."""
        if cache_salt is not None:
            raise ValueError("cache_salt is not supported across replicas")
        self.engine.check_prompt(prompt)
        return RemoteRequest(prompt, params or SamplingParams(), request_id)

    def _remember(self, request_id: str, replica_id: str) -> None:
        if request_id not in self.served_by:
            self.served_by[request_id] = replica_id
            while len(self.served_by) > SERVED_BY_KEPT:
                self.served_by.popitem(last=False)

    def check_capacity(self, count: int) -> None:
        """Nothing here: each replica has its own queue, and Ray's router holds what none has room for."""

    def prompt_progress(self, request_id: str) -> None:
        """Not known here (the replica reads the prompt): a stream's pings then say nothing of its
        progress."""
        return

    def end_streams(self, reason: str) -> None:
        """Nothing to end here: Ray stops the replicas, whose streams end with them."""

    def shutdown(self, reason: str = "", timeout: float | None = None) -> None:
        """The replicas are Ray's to stop."""


class ReplicasView:
    """``EngineView`` over every replica: counts summed, block tables merged (block ids are per replica,
    so ``held_blocks`` stays empty)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def snapshot(self, with_blocks: bool = True) -> EngineSnapshot:
        parts = self.handle.broadcast("snapshot", with_blocks).results(timeout_s=SNAPSHOT_TIMEOUT_S)
        return sum_snapshots(parts)


def sum_snapshots(parts: list[EngineSnapshot]) -> EngineSnapshot:
    total = EngineSnapshot(
        block_size=parts[0].block_size if parts else 0,
        num_blocks=sum(p.num_blocks for p in parts),
        num_free_blocks=sum(p.num_free_blocks for p in parts),
        num_used_blocks=sum(p.num_used_blocks for p in parts),
        usage=0.0,
        num_running=sum(p.num_running for p in parts),
        num_waiting=sum(p.num_waiting for p in parts),
        prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
        prefix_cache_hits=sum(p.prefix_cache_hits for p in parts),
        prefix_cache_disk_hits=sum(p.prefix_cache_disk_hits for p in parts),
        num_preemptions=sum(p.num_preemptions for p in parts),
        engine_alive=bool(parts) and all(p.engine_alive for p in parts),
        spec_draft_tokens=sum(p.spec_draft_tokens for p in parts),
        spec_accepted_tokens=sum(p.spec_accepted_tokens for p in parts),
        spec_verify_steps=sum(p.spec_verify_steps for p in parts),
    )
    total.usage = total.num_used_blocks / total.num_blocks if total.num_blocks else 0.0
    for p in parts:
        total.requests.update(p.requests)
    return total


class KVServeIngress:
    """The HTTP app: our routes over a ``RemoteEngine``, built when Ray starts the ingress replica.
    ``build_app`` is ``server.app.build_app``, handed down by whoever deploys (the app is a floor above)."""

    def __init__(self, engine_handle, server_config: ServerConfig, build_app: Callable) -> None:
        self.engine_handle = engine_handle
        self.server_config = server_config
        self.build_app = build_app

    async def __serve_build_asgi_app__(self):
        build_app = self.build_app
        described = await self.engine_handle.describe.remote()
        state = described["tokenizer"]
        facts = ReplicaFacts(
            Tokenizer(*state) if state else None, described["max_model_len"], described["model_config"],
            described["shifts_context"],
        )
        remote = RemoteEngine(self.engine_handle, facts)
        app = build_app(remote, self.server_config, described["card"], ReplicasView(self.engine_handle))

        @app.get("/v1/kvserve/replicas", tags=["Operations"])
        async def replicas() -> dict:
            """Which replica served each of the latest requests, by engine request id."""
            return {"served_by": dict(remote.served_by)}

        return app
