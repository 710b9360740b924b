"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request's block table is append-only while it runs:

    token positions   0 ........ 15 | 16 ....... 31 | 32 .. 40
    block table       [   b7        ,    b2         ,   b9    ]
    slot of pos p  =  block_table[p // block_size] * block_size + p % block_size

Full blocks are registered in the prefix cache when their tokens are scheduled; they are found again
by chained hash (see ``hashing``). A prefix hit stops at least one token short of the request's
known tokens, so the last token is always computed and yields logits.

With ``window`` (a ``WindowBlocks``), the sliding-window layers' blocks are a second group: each
request has a window table beside its block table, the same length, whose blocks out of the window
go back to the window pool as the request goes on (see ``kv.window_blocks``). A prefix hit is then
only as long as both groups can serve it. Loading a prefix (from the lower tier or a prompt-cache
file) loads the window parts its next query reads too: without them the hit would be cut short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvserve.kv.block_pool import BlockPool, BlockRef, KVBlock
from kvserve.kv.disk_tier import BlockKey
from kvserve.kv.hashing import PROCESS_KEY, extend_block_hashes, salt_digest, window_part_hash
from kvserve.kv.window_blocks import WINDOW_GROUP, WindowBlocks


class CacheableRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    block_hashes: list[int]
    num_computed_tokens: int
    cache_salt: str | None


@dataclass(slots=True)
class _Lookup:
    """A lookup that is not a request's (saving a prompt cache)."""

    all_token_ids: list[int]
    cache_salt: str | None
    request_id: str = "lookup"
    block_hashes: list[int] = field(default_factory=list)


class BlockSource(Protocol):
    """Where blocks can be loaded from into the pool (the disk tier, a prompt-cache file)."""

    def contains(self, block_hash: int) -> bool:
        """Whether it holds the block (or window part, see ``hashing.window_part_hash``) of that hash."""
        ...

    def load(self, block_ids: list[int], keys: list[BlockKey], group: int = 0) -> int:
        """Fill the pool's blocks ``block_ids`` with the blocks ``keys``; how many, from the first, it did.
        ``group`` 1: the window group's blocks, ``keys`` their ``BlockKey.window_part``s."""
        ...


class LowerTier(BlockSource, Protocol):
    """Where blocks evicted from the pool can still be found (the disk tier, through the storage)."""

    def touch(self, block_hashes: list[int], first_index: int = 0) -> None:
        """A request was admitted with these blocks as its prefix (its least recently used order),
        the first at position ``first_index`` of its chain."""
        ...


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_key: bytes = PROCESS_KEY,
        tier: LowerTier | None = None,
        window: WindowBlocks | None = None,
    ) -> None:
        self.block_size = block_size
        self.window = window
        self.enable_caching = enable_caching
        self.hash_key = hash_key
        self.tier = tier if enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are registered
        # per request, the cached block each registered position continues from (see cache_block)
        self.chains: dict[str, list[BlockRef]] = {}
        self.num_saved_blocks: dict[str, int] = {}  # how many of a request's blocks the lower tier was given
        self.prefix_queries = 0  # tokens looked up by admitted requests
        self.prefix_hits = 0  # of which found in the cache
        self.prefix_tier_hits = 0  # of which loaded from the lower tier
        self._tier_tokens: dict[str, int] = {}  # per waiting request: tokens its lookups loaded

    # --- lookup ---------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: CacheableRequest) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, as blocks and a token count (not yet referenced)."""
        if not self.enable_caching:
            return [], 0
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens, self.block_size, request.cache_salt, self.hash_key)
        hits = self._find(request, (len(tokens) - 1) // self.block_size)  # leave a token to compute
        if self.window is not None:
            if self.tier is not None:
                self._load_window_parts(request, hits, self.tier)
            hits = hits[: self.window.reusable_prefix(hits, request.block_hashes, tokens, request.cache_salt)]
        return hits, len(hits) * self.block_size

    def cached_prefix(self, token_ids: list[int], salt: str | None = None) -> list[KVBlock]:
        """The cached blocks (pool, then lower tier) holding the full blocks of ``token_ids``, as far as
        the chain goes. Not referenced: use them before the next allocation."""
        lookup = self._lookup(token_ids, salt)
        hits = self._find(lookup, len(token_ids) // self.block_size)
        self._tier_tokens.pop(lookup.request_id, None)
        return hits

    def cached_window_parts(self, token_ids: list[int], blocks: list[KVBlock],
                            salt: str | None = None) -> list[tuple[int, KVBlock]]:
        """(position, window block) of the window pool's cached parts of ``blocks`` (``cached_prefix``'s
        answer), after loading from the lower tier those a query after all of them reads. Not
        referenced: use them before the next allocation."""
        if self.window is None:
            return []
        lookup = self._lookup(token_ids, salt)
        if self.tier is not None:
            self._load_window_parts(lookup, blocks, self.tier)
        parts = ((i, self._window_hit(lookup, blocks, i)) for i in range(len(blocks)))
        return [(i, b) for i, b in parts if b is not None]

    def block_hashes_of(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        return self._lookup(token_ids, salt).block_hashes

    def _lookup(self, token_ids: list[int], salt: str | None) -> _Lookup:
        lookup = _Lookup(list(token_ids), salt)
        extend_block_hashes(lookup.block_hashes, lookup.all_token_ids, self.block_size, salt, self.hash_key)
        return lookup

    def _find(self, request: CacheableRequest, max_blocks: int) -> list[KVBlock]:
        hits = self._pool_hits(request, [], max_blocks)
        if self.tier is not None and len(hits) < max_blocks and self._load_from_tier(request, hits, max_blocks):
            hits = self._pool_hits(request, hits, max_blocks)
        return hits

    def _pool_hits(self, request: CacheableRequest, hits: list[KVBlock], max_blocks: int) -> list[KVBlock]:
        """``hits`` extended by the blocks of the pool's cache that continue the request's chain."""
        hits = list(hits)
        bs = self.block_size
        for i in range(len(hits), max_blocks):
            chunk = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(request.block_hashes[i], chunk, hits[-1].ref if hits else None, request.cache_salt)
            if block is None:
                break
            hits.append(block)
        return hits

    def _load_from_tier(self, request: CacheableRequest, hits: list[KVBlock], max_blocks: int) -> int:
        """Load the blocks after ``hits`` that the lower tier holds into free blocks of the pool, and
        cache them there (as cached-free blocks, like any hit not taken yet). Returns how many."""
        hashes, start = request.block_hashes, len(hits)
        count = 0
        while start + count < max_blocks and self.tier.contains(hashes[start + count]):
            count += 1
        cached = self._install(request, hits, count, self.tier)
        self._tier_tokens[request.request_id] = self._tier_tokens.get(request.request_id, 0) + cached * self.block_size
        return cached

    def install_prefix(self, token_ids: list[int], source: BlockSource, salt: str | None = None) -> int:
        """Cache the full blocks of ``token_ids`` that the pool lacks, loaded from ``source`` (a
        prompt-cache file), as far as the pool has room. Returns how many blocks of the prefix the
        pool now caches."""
        lookup = self._lookup(token_ids, salt)
        max_blocks = len(token_ids) // self.block_size
        hits = self._pool_hits(lookup, [], max_blocks)
        self._install(lookup, hits, max_blocks - len(hits), source)
        hits = self._pool_hits(lookup, hits, max_blocks)
        if self.window is None:
            return len(hits)
        self._load_window_parts(lookup, hits, source)
        return self.window.reusable_prefix(hits, lookup.block_hashes, lookup.all_token_ids, salt)

    def _install(self, request: CacheableRequest, hits: list[KVBlock], count: int, source: BlockSource) -> int:
        """Load the ``count`` blocks after ``hits`` from ``source`` into free blocks, cached-free."""
        start = len(hits)
        if not count:
            return 0
        self.pool.touch(hits)  # the allocation below must not evict them
        try:
            count = min(count, self.pool.num_free_blocks)
            if not count:
                return 0
            blocks = self.pool.allocate(count)
            keys = [self._block_key(request, i) for i in range(start, start + count)]
            loaded = source.load([b.block_id for b in blocks], keys)
            parent = hits[-1].ref if hits else None
            cached = 0
            for block, key in zip(blocks[:loaded], keys):
                ref = self.pool.cache_block(block, key.block_hash, key.token_ids, parent, request.cache_salt)
                if ref != block.ref:  # the pool holds this hash for another chain: stop here
                    break
                parent, cached = ref, cached + 1
            self.pool.uncache(blocks[cached:])
            self.pool.free(list(reversed(blocks)))
        finally:
            self.pool.free(list(reversed(hits)))
        return cached

    def _block_key(self, request: CacheableRequest, index: int) -> BlockKey:
        return BlockKey.in_chain(request.block_hashes, index, self._chunk(request, index),
                                 salt_digest(request.cache_salt))

    def _chunk(self, request: CacheableRequest, index: int) -> tuple[int, ...]:
        """The tokens of the request's block ``index``."""
        return tuple(request.all_token_ids[index * self.block_size : (index + 1) * self.block_size])

    # --- the window group's parts ---------------------------------------------------------------------
    def _window_hit(self, request: CacheableRequest, hits: list[KVBlock], index: int) -> KVBlock | None:
        """The window pool's cached part of block ``index``, tied to the full group's ``hits[index]``."""
        return self.window.lookup(index, hits, request.block_hashes, request.all_token_ids, request.cache_salt)

    def _load_window_parts(self, request: CacheableRequest, hits: list[KVBlock], source: BlockSource) -> None:
        """Load from ``source`` the window parts a query after ``hits`` reads (``first_live`` .. the
        last hit) that the window pool lacks. A part ``source`` cannot give (absent, corrupt) cuts the
        hit before it, so the window ending there is tried next; a window pool without room for the
        parts gives up (``reusable_prefix`` then cuts the hit to what the pool holds)."""
        end = len(hits)
        while end > 0:
            live = range(self.window.first_live(end * self.block_size), end)
            found = [self._window_hit(request, hits, i) for i in live]
            missing = [i for i, block in zip(live, found) if block is None]
            held = [block for block in found if block is not None]
            absent = next((i for i in missing if not self._source_has_part(source, request, i)), None)
            if absent is not None:  # checked before allocating: an allocation evicts cached window blocks
                end = absent
                continue
            if not missing or len(missing) > self.window.num_free_blocks - self.window.num_evictable(held):
                return
            loaded = self._install_window_parts(request, hits, missing, held, source)
            if loaded == len(missing):
                return
            end = missing[loaded]

    @staticmethod
    def _source_has_part(source: BlockSource, request: CacheableRequest, index: int) -> bool:
        return source.contains(window_part_hash(request.block_hashes[index]))

    def _install_window_parts(self, request: CacheableRequest, hits: list[KVBlock], indices: list[int],
                              held: list[KVBlock], source: BlockSource) -> int:
        """Load the window parts of blocks ``indices`` from ``source`` into free blocks of the window pool,
        cached-free and tied to the full group's blocks ``hits`` as ``WindowBlocks.cache_block`` ties
        computed ones; ``held``: cached parts the same query reads, kept from eviction meanwhile.
        Returns how many, from the first, are cached now."""
        pool = self.window.pool
        self._drop_stale_window_parts(request, indices)
        pool.touch(held)
        try:
            blocks = pool.allocate(len(indices))
            keys = [self._block_key(request, i).window_part() for i in indices]
            loaded = source.load([b.block_id for b in blocks], keys, WINDOW_GROUP)
            cached = 0
            for block, key in zip(blocks[:loaded], keys):
                full_ref = hits[key.index].ref
                ref = pool.cache_block(block, key.parent_hash, key.token_ids, full_ref, request.cache_salt)
                if ref != block.ref:  # the hash is held by a block in use under another full block
                    break
                cached += 1
            pool.uncache(blocks[cached:])
            pool.free(list(reversed(blocks)))
        finally:
            pool.free(list(reversed(held)))
        return cached

    def _drop_stale_window_parts(self, request: CacheableRequest, indices: list[int]) -> None:
        """A free window block cached under one of these hashes but tied to a full block that is gone
        (evicted, then loaded again as another block) can serve no hit: out of the cache, so the
        loaded part can take its hash."""
        pool = self.window.pool
        stale = [pool.cached.get(request.block_hashes[i]) for i in indices]
        pool.uncache([b for b in stale if b is not None and b.ref_count == 0])

    def record_prefix_lookup(self, request: CacheableRequest, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a blocked request's retries are not counted)."""
        self.prefix_queries += len(request.all_token_ids)
        self.prefix_hits += num_hit_tokens
        self.prefix_tier_hits += min(self._tier_tokens.pop(request.request_id, 0), num_hit_tokens)
        if self.tier is not None and num_hit_tokens:
            num_blocks = num_hit_tokens // self.block_size
            self.tier.touch(request.block_hashes[:num_blocks])
            if self.window is not None:
                first = self.window.first_live(num_hit_tokens)
                self.tier.touch([window_part_hash(h) for h in request.block_hashes[first:num_blocks]], first)

    # --- allocation -----------------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self, request: CacheableRequest, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` after the request's computed tokens (and after
        ``computed_blocks``, a prefix hit being taken now). Returns False, changing nothing, when the
        pool cannot supply the blocks."""
        computed_blocks = computed_blocks or []
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(blocks) - len(computed_blocks)
        # cached-free hits leave the free queue when touched, so they do not count as available
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return False
        window_hits: list[KVBlock] = []
        if self.window is not None:
            self.window.release(rid, request.num_computed_tokens)  # always right: computed counts only grow
            if computed_blocks:
                window_hits = self.window.hit_blocks(computed_blocks, request.block_hashes, request.all_token_ids,
                                                     request.cache_salt)
            needed = self.window.blocks_needed(rid, num_computed, self.blocks_needed(total), len(computed_blocks))
            if needed > self.window.num_free_blocks - self.window.num_evictable(window_hits):
                return False
            self.window.allocate(rid, num_computed, self.blocks_needed(total), window_hits)
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        if computed_blocks:  # prefix hits are taken only when the table is still empty
            assert not blocks
            self.num_cached_blocks[request.request_id] = len(computed_blocks)
            self.num_saved_blocks[request.request_id] = len(computed_blocks)  # cached: saved when computed
            self.chains[request.request_id] = [b.ref for b in computed_blocks]
        blocks.extend(computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        self.num_cached_blocks.setdefault(request.request_id, 0)
        self._cache_full_blocks(request, total)
        return True

    def _cache_full_blocks(self, request: CacheableRequest, num_tokens: int) -> None:
        """Register the blocks that are full once ``num_tokens`` tokens are computed."""
        if not self.enable_caching:
            return
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens[:num_tokens], self.block_size, request.cache_salt, self.hash_key)
        blocks = self.req_blocks[request.request_id]
        start = self.num_cached_blocks[request.request_id]
        num_full = min(num_tokens, len(tokens)) // self.block_size  # speculative drafts are no tokens yet
        chain = self.chains.setdefault(request.request_id, [])
        for i in range(start, num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = chain[i - 1] if i else None
            chain.append(self.pool.cache_block(blocks[i], request.block_hashes[i], chunk, parent, request.cache_salt))
            if self.window is not None:
                self.window.cache_block(request.request_id, i, request.block_hashes[i], chunk, chain[i],
                                        request.cache_salt)
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def unsaved_blocks(self, request: CacheableRequest) -> list[tuple[int, KVBlock]]:
        """(position, block) of the request's cached blocks whose tokens are all computed and that the
        lower tier was not given yet; they count as given from now on."""
        rid = request.request_id
        first = self.num_saved_blocks.get(rid, 0)
        last = min(self.num_cached_blocks.get(rid, 0), request.num_computed_tokens // self.block_size)
        blocks = self.req_blocks.get(rid, [])
        self.num_saved_blocks[rid] = max(first, last)
        return [(i, blocks[i]) for i in range(first, last) if blocks[i].block_hash == request.block_hashes[i]]

    def forget_uncomputed(self, request: CacheableRequest) -> None:
        """Take the request's blocks from its first not-yet-computed token on out of the prefix cache
        (they were registered when scheduled, before a forward that did not happen)."""
        blocks = self.req_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        self.pool.uncache(blocks[first:])
        if self.window is not None:
            self.window.forget_from(request.request_id, first)
        kept = min(self.num_cached_blocks.get(request.request_id, 0), first)
        self.num_cached_blocks[request.request_id] = kept
        del self.chains.setdefault(request.request_id, [])[kept:]

    def free(self, request: CacheableRequest) -> None:
        """Release every block of the request, tail first (so tail blocks are evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_saved_blocks.pop(request.request_id, None)
        self._tier_tokens.pop(request.request_id, None)
        self.chains.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
        if self.window is not None:
            self.window.free(request.request_id)

    # --- views ----------------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def window_block(self, request_id: str, index: int) -> KVBlock | None:
        """The request's window block ``index`` (None: out of the window, or no window group)."""
        return None if self.window is None else self.window.block(request_id, index)

    def window_block_ids(self, request_id: str) -> list[int] | None:
        """The request's window table (the null block where blocks fell out), or None without a window group."""
        return None if self.window is None else self.window.block_ids(request_id)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.window is not None:
            self.window.pool.reset_prefix_cache()
