"""One read of the KV cache for what shows it or routes by it: the web page's pool view, ``/metrics``
and ``/v1/kvserve/cache``, the replicas' prefix router. Each KV group is read the same way (its pool's
blocks, the requests' tables), so no view reaches into the manager or tells one group from another by
its internals. Taken under the engine's lock, between steps: the counts and tables agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.kv.manager import KVCacheManager

FULL, WINDOW = "full", "window"


@dataclass(slots=True)
class KVGroupSnapshot:
    """One KV group: ``FULL`` (every layer's blocks) or ``WINDOW`` (the sliding-window layers')."""

    name: str
    kv_group: int  # the storage's group of its layers (``PagedKVStorage.kv_group_bytes_per_block``)
    window: int | None  # tokens a layer of the group reads back; None: every token
    num_blocks: int  # the pool's blocks (the window pool's null block included)
    num_free: int  # free plus cached-free
    num_held: int  # held by requests (the null block not counted)
    # per block (the null block left out): its ref count, or -1 where a free block keeps its prefix hash
    block_states: list[int] | None = None
    tables: dict[str, list[int]] | None = None  # request id -> its block ids (0: the window's null block)

    @property
    def usage(self) -> float:
        """Fraction of its usable blocks held by requests."""
        usable = self.num_free + self.num_held
        return self.num_held / usable if usable else 0.0


@dataclass(slots=True)
class KVSnapshot:
    block_size: int
    hash_key: bytes | None  # what block hashes are keyed with (replicas compare it)
    prefix_queries: int  # tokens looked up by admitted requests
    prefix_hits: int  # of which found in the cache
    prefix_tier_hits: int  # of which loaded from the lower tier
    groups: list[KVGroupSnapshot]  # the full group first; the window group where the model has one
    cached: list[int] | None = None  # the full group's cached block hashes (the router's view)

    @property
    def full(self) -> KVGroupSnapshot:
        return self.group(FULL)

    @property
    def window(self) -> KVGroupSnapshot | None:
        return self.group(WINDOW)

    def group(self, name: str) -> KVGroupSnapshot | None:
        return next((g for g in self.groups if g.name == name), None)


def take(kv: KVCacheManager, blocks: bool = False, tables: bool = False, cached: bool = False) -> KVSnapshot:
    """``kv`` as it stands: counts always; ``blocks``: each block's state; ``tables``: each request's block
    table; ``cached``: the cached block hashes."""
    return KVSnapshot(kv.block_size, kv.hash_key, kv.prefix_queries, kv.prefix_hits, kv.prefix_tier_hits,
                      [group.snapshot(blocks, tables) for group in kv.groups],
                      list(kv.full.pool.cached) if cached else None)
