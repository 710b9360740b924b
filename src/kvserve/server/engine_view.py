"""Read-only snapshots of the engine's bookkeeping for ``/metrics`` and ``/v1/kvserve/cache``.

A snapshot is taken under ``AsyncLLMEngine.lock``, so it never sees a step half done: every block
with a reference belongs to a live request (``held_blocks`` is the union of ``requests``' tables,
prefix-shared blocks counted once). Callers on the event loop run it in a worker thread, because
the lock is held for a whole engine step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvserve.engine.async_engine import AsyncLLMEngine


@dataclass(slots=True)
class DiskCacheSnapshot:
    """The prefix cache's disk tier (``--kv-disk-cache``): the directory as this server last saw it
    (other servers sharing it included) and this server's reads and writes since it started."""

    directory: str
    max_bytes: int
    blocks_on_disk: int
    bytes_on_disk: int
    blocks_written: int
    bytes_written: int
    write_seconds: float
    blocks_read: int
    bytes_read: int
    read_seconds: float
    rejected_files: int  # corrupt, truncated or written for another setup: removed
    dropped_writes: int
    evicted_files: int


@dataclass(slots=True)
class EngineSnapshot:
    block_size: int
    num_blocks: int
    num_free_blocks: int  # free plus cached-free: what an allocation can take now
    num_used_blocks: int
    usage: float  # the fuller group's held fraction: num_used_blocks / num_blocks, or the window group's
    num_running: int
    num_waiting: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found (in RAM or on disk)
    prefix_cache_disk_hits: int  # of which loaded from the disk tier
    num_preemptions: int
    engine_alive: bool
    spec_draft_tokens: int = 0  # speculative tokens verified
    spec_accepted_tokens: int = 0  # of which kept
    # request-steps that verified drafts: tokens per step = (accepted + steps) / steps
    spec_verify_steps: int = 0
    requests: dict[str, list[int]] = field(default_factory=dict)  # request id -> block table
    held_blocks: list[int] = field(default_factory=list)  # block ids with a reference, sorted
    # the sliding-window layers' pool (kv.groups); 0 blocks: no window group
    window_blocks: int = 0  # the null block included
    window_free_blocks: int = 0  # free plus cached-free
    window_size: int = 0  # tokens a sliding layer reads back
    window_tables: dict[str, list[int]] = field(default_factory=dict)  # request id -> window table (0: null)
    disk_cache: DiskCacheSnapshot | None = None  # None: no disk tier

    def to_json(self) -> dict:
        return asdict(self)


class EngineView:
    def __init__(self, async_engine: AsyncLLMEngine) -> None:
        self.async_engine = async_engine

    def snapshot(self, with_blocks: bool = True) -> EngineSnapshot:
        engine = self.async_engine.engine
        with self.async_engine.lock:
            kv = engine.kv.snapshot(blocks=with_blocks, tables=with_blocks)
            full, window = kv.full, kv.window
            snap = EngineSnapshot(
                block_size=kv.block_size,
                num_blocks=full.num_blocks,
                num_free_blocks=full.num_free,
                num_used_blocks=full.num_held,
                usage=full.usage,
                num_running=len(engine.scheduler.running),
                num_waiting=len(engine.scheduler.waiting) + self.async_engine.num_pending_adds,
                prefix_cache_queries=kv.prefix_queries,
                prefix_cache_hits=kv.prefix_hits,
                prefix_cache_disk_hits=kv.prefix_tier_hits,
                num_preemptions=engine.num_preemptions,
                engine_alive=self.async_engine.dead_error is None,
                spec_draft_tokens=engine.num_draft_tokens,
                spec_accepted_tokens=engine.num_accepted_tokens,
                spec_verify_steps=engine.num_verify_steps,
            )
            if window is not None:
                snap.window_blocks, snap.window_size = window.num_blocks, window.window
                snap.window_free_blocks = window.num_free
                snap.usage = max(snap.usage, window.usage)
            if engine.disk is not None:
                snap.disk_cache = DiskCacheSnapshot(str(engine.disk.root), engine.disk.max_bytes,
                                                    **engine.disk.stats.to_json())
            if with_blocks:
                snap.requests = full.tables
                snap.held_blocks = [i for i, state in enumerate(full.block_states) if state > 0]
                if window is not None:
                    snap.window_tables = window.tables
        return snap
