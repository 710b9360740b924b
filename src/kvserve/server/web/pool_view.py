"""One frame of the KV pool for the web page: every block's state as one character, each live request's
blocks and context, and the counters a page turns into rates.

Block codes (``PoolFrame.blocks``, one character per block id)::

    .        free                 ref_count 0, no prefix hash
    c        cached-free          ref_count 0, hash kept: a later prompt with this prefix revives it
    1 .. 9   in use by n          ref_count n: 2 and more are prefix blocks shared by several requests
    +        in use by 10 or more

The engine is read under ``AsyncLLMEngine.lock``, like ``EngineView``'s snapshot, so a frame never sees
a step half done; the lock is held for one pass over the blocks (a list of ints) and the few live
requests, and everything else (the code string, counts, JSON) is built after it is released.
"""

from __future__ import annotations

import time
from dataclasses import asdict, field
from typing import TYPE_CHECKING

from pydantic import ConfigDict, TypeAdapter
from pydantic.dataclasses import dataclass

from kvserve.server.model_slots import ModelEvent, ModelState

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.kv.snapshot import KVGroupSnapshot

# indexed by a block's value in the pass: -1 (cached-free) is the last character
CODES = ".123456789c"
SHARED_MAX = 9  # ref counts above this are drawn as "+"


EXACT = ConfigDict(extra="forbid")  # pydantic dataclasses: the OpenAPI document's stream item schema


@dataclass(slots=True, config=EXACT)
class PoolRequest:
    id: str
    status: str  # running, waiting, preempted
    blocks: list[int]  # its block table, in token order
    num_tokens: int  # in its context now (prompt + generated)
    max_tokens: int  # its limit: the context, or prompt + max_tokens when that is less
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (0 until scheduled)
    num_computed_tokens: int  # with K/V in the pool
    kv_bytes: int  # bytes its blocks hold (whole blocks, in both pools)
    window_blocks: list[int] = field(default_factory=list)  # its window table (0: fell out of the window)


@dataclass(slots=True, config=EXACT)
class PoolFrame:
    time: float  # server wall clock, seconds
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    cache_type_k: str
    cache_type_v: str
    kv_bytes_per_token: int
    kv_pool_bytes: int
    blocks: str  # one code per block, see the module docstring
    num_free_blocks: int  # free plus cached-free: what an allocation can take now
    num_cached_free_blocks: int
    num_used_blocks: int
    num_shared_blocks: int  # in use by two requests or more
    usage: float  # num_used_blocks / num_blocks
    num_running: int
    num_waiting: int
    prefix_cache_queries: int  # prompt tokens looked up, since the start
    prefix_cache_hits: int  # of which found
    num_preemptions: int
    num_generated_tokens: int  # since the start: a page's tok/s is its change over time
    num_prompt_tokens: int
    engine_alive: bool
    requests: list[PoolRequest] = field(default_factory=list)
    # the sliding-window layers' own pool (kv.groups), coded like ``blocks``; "" without one
    window_blocks: str = ""
    window_size: int = 0  # tokens a sliding layer reads back
    # every model the server holds, this one among them, and its last loads and unloads (server.model_slots)
    models: list[ModelState] = field(default_factory=list)
    model_events: list[ModelEvent] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def encode(self) -> bytes:
        """Compact JSON, as ``to_json`` would dump it, ~20x faster (pydantic's serializer)."""
        return _FRAME.dump_json(self)


_FRAME = TypeAdapter(PoolFrame)


def block_codes(values: list[int]) -> str:
    """``values``: per block its ref count, or -1 for cached-free."""
    return "".join([CODES[v] if v <= SHARED_MAX else "+" for v in values])


class PoolView:
    def __init__(self, async_engine: AsyncLLMEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name

    def frame(self) -> PoolFrame:
        engine = self.async_engine.engine
        with self.async_engine.lock:
            # per block its ref count, or -1 where a free block keeps its prefix hash: one pass each
            kv = engine.kv.snapshot(blocks=True, tables=True)
            full, window = kv.full, kv.window
            values = full.block_states
            scheduler = engine.scheduler
            live = [*scheduler.running, *scheduler.waiting]
            tables = [full.tables.get(r.request_id, []) for r in live]
            window_values = [] if window is None else window.block_states
            window_tables = [[] if window is None else window.tables.get(r.request_id, []) for r in live]
            rows = [
                (
                    r.request_id,
                    r.status.value,
                    r.num_tokens,
                    r.max_total_tokens,
                    r.num_prompt_tokens,
                    max(r.num_cached_tokens, 0),
                    r.num_computed_tokens,
                )
                for r in live
            ]
            counters = (
                kv.prefix_queries,
                kv.prefix_hits,
                engine.num_preemptions,
                engine.num_generated_tokens,
                engine.num_prompt_tokens,
                len(scheduler.running),
                len(scheduler.waiting) + self.async_engine.num_pending_adds,
            )
        return self._build(engine, values, rows, tables, counters, window_values, window_tables, window)

    def _build(
        self, engine, values: list[int], rows: list[tuple], tables: list[list[int]], counters: tuple,
        window_values: list[int], window_tables: list[list[int]], window: KVGroupSnapshot | None,
    ) -> PoolFrame:
        cache = engine.config.cache
        bytes_per_token = engine.kv_bytes_per_token
        storage = engine.storage
        block_bytes = storage.bytes_per_block
        window_block_bytes = 0 if window is None else storage.kv_group_bytes_per_block(window.kv_group)
        window_size = 0 if window is None else window.window
        num_blocks = len(values)
        num_free = values.count(0)
        num_cached_free = values.count(-1)
        num_used = num_blocks - num_free - num_cached_free
        queries, hits, preemptions, generated, prompted, running, waiting = counters
        requests = [
            PoolRequest(rid, status, table, tokens, limit, prompt, cached, computed,
                        len(table) * block_bytes + sum(1 for b in wt if b) * window_block_bytes, wt)
            for (rid, status, tokens, limit, prompt, cached, computed), table, wt in zip(
                rows, tables, window_tables, strict=True)
        ]
        return PoolFrame(
            time=time.time(),
            model=self.model_name,
            block_size=cache.block_size,
            num_blocks=num_blocks,
            max_model_len=engine.max_model_len,
            cache_type_k=cache.cache_type_k,
            cache_type_v=cache.cache_type_v_resolved,
            kv_bytes_per_token=bytes_per_token,
            kv_pool_bytes=storage.nbytes,
            blocks=block_codes(values),
            num_free_blocks=num_free + num_cached_free,
            num_cached_free_blocks=num_cached_free,
            num_used_blocks=num_used,
            num_shared_blocks=sum(1 for v in values if v > 1),
            usage=num_used / num_blocks,
            num_running=running,
            num_waiting=waiting,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            num_generated_tokens=generated,
            num_prompt_tokens=prompted,
            engine_alive=self.async_engine.dead_error is None,
            requests=requests,
            window_blocks=block_codes(window_values),
            window_size=window_size,
        )
