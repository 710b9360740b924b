"""N engine replicas as Ray Serve deployments behind one app of our OpenAI / Ollama / Anthropic routes.

    client --HTTP--> Ray's proxy --> KVServeIngress (build_app over a RemoteEngine)
                                       | tokenizes with the model's tokenizer
                                       | generate(prompt_token_ids, params, request_id)
                                       v
                                     KVPrefixRouter (in the ingress process): block-hash chain of the
                                       | prompt vs each replica's reported cache, then queue length
                      +----------------+----------------+
                      v                                 v
                 EngineReplica 1                   EngineReplica N     one LLMEngine and KV pool each;
                 record_routing_stats(): hash key, block size, cached block hashes

The ingress holds no weights: what the routes read of the engine (tokenizer, context length, model
card) comes from a replica once at start (``describe``), and every request goes to a replica as
token ids, so the router and the replica hash the very same tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvserve.config import EngineConfig
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.events import wire_hash
from kvserve.server.api_errors import engine_error
from kvserve.server.engine_view import EngineSnapshot, EngineView
from kvserve.server.replicas.ray_ingress import KVServeIngress, ReplicaRefusal
from kvserve.server.server_config import ServerConfig

# how stale the router's picture of a replica's cache may be (the chains it sent since fill the gap)
ROUTING_STATS_PERIOD_S = 1.0


class EngineReplica:
    """One engine with its own KV pool. Ray restarts a replica that dies; its cache starts empty."""

    def __init__(self, engine_config: EngineConfig, model_name: str, prompt_cache: str | None = None) -> None:
        from kvserve.engine.async_engine import AsyncLLMEngine
        from kvserve.engine.engine import LLMEngine
        from kvserve.server.model_card import ModelCard

        engine = LLMEngine.from_config(engine_config, auto_pull=True)
        if prompt_cache:
            from kvserve.kv.prompt_cache import load_prompt_cache

            load_prompt_cache(engine.cache, prompt_cache)
        self.async_engine = AsyncLLMEngine(engine)
        self.card = ModelCard.from_engine(engine, model_name)
        self.card.digest()  # here, where the file is: the ingress may run on a node without it
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        """The engine's outputs, each with this replica's id (which replica served a request is what
        the routing tests check). Admission errors raise before the first output, as ``ReplicaRefusal``."""
        try:
            async for out in self.async_engine.generate(prompt_token_ids, params, request_id):
                yield self.replica_id, out
        except Exception as e:  # mapped as the one-engine server maps them, or re-raised
            mapped = engine_error(e)
            if mapped is None:
                raise
            raise ReplicaRefusal.from_api_error(mapped) from None

    def describe(self) -> dict[str, Any]:
        engine = self.async_engine.engine
        t = engine.tokenizer
        tokenizer = (
            None if t is None else (t.backend, t.bos_token_id, t.eos_token_ids, t.chat_template, t.add_bos)
        )
        return {
            "card": self.card,
            "max_model_len": engine.max_model_len,
            "shifts_context": engine.scheduler.shifts_context,
            "model_config": engine.model_config,
            # Tokenizer's constructor arguments: it holds a lock, which does not pickle
            "tokenizer": tokenizer,
        }

    async def snapshot(self, with_blocks: bool) -> EngineSnapshot:
        return await asyncio.to_thread(EngineView(self.async_engine).snapshot, with_blocks)

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router knows of this replica's cache (``prefix_router.ReplicaReport``)."""
        return await asyncio.to_thread(self._routing_stats)

    def _routing_stats(self) -> dict[str, Any]:
        engine = self.async_engine.engine
        with self.async_engine.lock:  # between steps: the cached set is whole
            kv = engine.kv.snapshot(cached=True)
        return {"hash_key": kv.hash_key, "block_size": kv.block_size,
                "cached": [wire_hash(h) for h in kv.cached]}

    def __del__(self) -> None:
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown()


def build_application(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    num_replicas: int,
    build_app: Callable,
    prompt_cache: str | None = None,
    policy: str = "prefix",
):
    """The Serve application: ``serve.run(build_application(...))``. Each replica reserves
    ``engine_config.num_threads`` CPUs (1 when unset), so Ray places no more replicas on a node than
    its cores hold. ``build_app``: ``server.app.build_app`` (the ingress builds the routes with it)."""
    num_cpus = engine_config.num_threads or 1
    max_num_seqs = engine_config.scheduler.max_num_seqs
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus},
        # running plus as many waiting in the engine's queue: more wait in Ray's router, free to go to
        # whichever replica frees a slot first
        max_ongoing_requests=2 * max_num_seqs,
        request_router_config=RequestRouterConfig(
            request_router_class="kvserve.server.replicas.ray_router:KVPrefixRouter",
            request_router_kwargs={
                "block_size": engine_config.cache.block_size,
                "imbalance_threshold": max_num_seqs,
                "policy": policy,
            },
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=10 * ROUTING_STATS_PERIOD_S,
        ),
        health_check_period_s=2,
    ).bind(engine_config, server_config.model_name, prompt_cache)
    ingress = serve.deployment(
        serve.ingress()(KVServeIngress),
        name="KVServeIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,  # requests wait in the engines' queues, not here
    )
    return ingress.bind(engine, server_config, build_app)
