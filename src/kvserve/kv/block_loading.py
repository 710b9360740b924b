"""Blocks loaded into the pool from elsewhere: the lower tier (disk) when a lookup runs past the pool's
cache, and prompt-cache files. A loaded block is cached-free, like any hit not taken yet, tied into
its chain exactly as a computed one would be; where the pool already caches that hash under another
chain, loading stops there.

A prefix is only as long as every KV group can serve it (``kv.groups``), so loading a prefix also loads
the other groups' parts its next query reads (``KVGroup.first_live`` .. the last block: the last window's,
for the sliding-window layers); without them the hit would be cut short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.disk_tier import BlockKey
from kvserve.kv.hashing import salt_digest

if TYPE_CHECKING:
    from kvserve.kv.groups import KVGroup


class CacheableRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    block_hashes: list[int]
    num_computed_tokens: int
    cache_salt: str | None


@dataclass(slots=True)
class Lookup:
    """A lookup that is not a request's (saving or loading a prompt cache)."""

    all_token_ids: list[int]
    cache_salt: str | None
    request_id: str = "lookup"
    block_hashes: list[int] = field(default_factory=list)


class BlockSource(Protocol):
    """Where blocks can be loaded from into the pool (the disk tier, a prompt-cache file)."""

    def contains(self, block_hash: int) -> bool:
        """Whether it holds the block (or a group's part of one, ``KVGroup.part_hash``) of that hash."""
        ...

    def load(self, block_ids: list[int], keys: list[BlockKey], kv_group: int = 0) -> int:
        """Fill the pool's blocks ``block_ids`` with the blocks ``keys``; how many, from the first, it did.
        ``kv_group``: the storage's group they are parts of (``keys``: their ``KVGroup.part_key``s)."""
        ...


class LowerTier(BlockSource, Protocol):
    """Where blocks evicted from the pool can still be found (the disk tier, through the storage)."""

    def touch(self, block_hashes: list[int], first_index: int = 0) -> None:
        """A request was admitted with these blocks as its prefix (its least recently used order),
        the first at position ``first_index`` of its chain."""
        ...


class BlockLoader:
    """Loads a chain into the full group's pool (``load``), and any group's parts of it (``load_parts``)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool  # the full group's
        self.block_size = block_size

    def num_held(self, source: BlockSource, request: CacheableRequest, start: int, max_blocks: int) -> int:
        """How many blocks of the request's chain from ``start`` (up to ``max_blocks``) ``source`` holds."""
        count = 0
        while start + count < max_blocks and source.contains(request.block_hashes[start + count]):
            count += 1
        return count

    def load(self, request: CacheableRequest, hits: list[KVBlock], count: int, source: BlockSource) -> int:
        """Load the ``count`` blocks after ``hits`` from ``source`` into free blocks, cached-free.
        Returns how many, from the first, are cached now."""
        start = len(hits)
        if not count:
            return 0
        self.pool.touch(hits)  # the allocation below must not evict them
        try:
            count = min(count, self.pool.num_free_blocks)
            if not count:
                return 0
            blocks = self.pool.allocate(count)
            keys = [self.block_key(request, i) for i in range(start, start + count)]
            loaded = source.load([b.block_id for b in blocks], keys)
            parent = hits[-1].ref if hits else None
            cached = 0
            for block, key in zip(blocks[:loaded], keys, strict=False):
                ref = self.pool.cache_block(block, key.block_hash, key.token_ids, parent, request.cache_salt)
                if ref != block.ref:  # the pool holds this hash for another chain: stop here
                    break
                parent, cached = ref, cached + 1
            self.pool.uncache(blocks[cached:])
            self.pool.free(list(reversed(blocks)))
        finally:
            self.pool.free(list(reversed(hits)))
        return cached

    def block_key(self, request: CacheableRequest, index: int) -> BlockKey:
        bs = self.block_size
        chunk = tuple(request.all_token_ids[index * bs : (index + 1) * bs])
        return BlockKey.in_chain(request.block_hashes, index, chunk, salt_digest(request.cache_salt))

    # --- another group's parts ------------------------------------------------------------------------
    def load_parts(self, group: KVGroup, request: CacheableRequest, hits: list[KVBlock],
                   source: BlockSource) -> None:
        """Load from ``source`` the parts of ``group`` a query after ``hits`` reads (``first_live`` .. the
        last hit) that its pool lacks. A part ``source`` cannot give (absent, corrupt) cuts the hit
        before it, so the live range ending there is tried next; a pool without room for the parts
        gives up (``reusable_prefix`` then cuts the hit to what the pool holds)."""
        end = len(hits)
        while end > 0:
            live = range(group.first_live(end * self.block_size), end)
            found = [group.part(i, hits, request) for i in live]
            missing = [i for i, block in zip(live, found, strict=True) if block is None]
            held = [block for block in found if block is not None]
            absent = next(
                (i for i in missing if not source.contains(group.part_hash(request.block_hashes[i]))), None)
            if absent is not None:  # checked before allocating: an allocation evicts cached parts
                end = absent
                continue
            if not missing or len(missing) > group.num_free_blocks - group.num_evictable(held):
                return
            loaded = self._load_parts(group, request, hits, missing, held, source)
            if loaded == len(missing):
                return
            end = missing[loaded]

    def _load_parts(self, group: KVGroup, request: CacheableRequest, hits: list[KVBlock], indices: list[int],
                    held: list[KVBlock], source: BlockSource) -> int:
        """Load the parts of blocks ``indices`` from ``source`` into free blocks of ``group``'s pool,
        cached-free and tied to the full group's blocks ``hits`` as the manager ties computed ones;
        ``held``: cached parts the same query reads, kept from eviction meanwhile. Returns how many,
        from the first, are cached now."""
        pool = group.pool
        # a free part cached under one of these hashes but tied to a full block that is gone (evicted,
        # then loaded again as another block) can serve no hit: out of the cache, so the loaded part
        # can take its hash
        stale = [pool.cached.get(request.block_hashes[i]) for i in indices]
        pool.uncache([b for b in stale if b is not None and b.ref_count == 0])
        pool.touch(held)
        try:
            blocks = pool.allocate(len(indices))
            keys = [group.part_key(self.block_key(request, i)) for i in indices]
            loaded = source.load([b.block_id for b in blocks], keys, group.kv_group)
            cached = 0
            for block, key in zip(blocks[:loaded], keys, strict=False):
                full_ref = hits[key.index].ref
                ref = pool.cache_block(block, request.block_hashes[key.index], key.token_ids, full_ref,
                                       request.cache_salt)
                if ref != block.ref:  # the hash is held by a block in use under another full block
                    break
                cached += 1
            pool.uncache(blocks[cached:])
            pool.free(list(reversed(blocks)))
        finally:
            pool.free(list(reversed(held)))
        return cached
