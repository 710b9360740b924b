"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request's block table is append-only while it runs:

    token positions   0 ........ 15 | 16 ....... 31 | 32 .. 40
    block table       [   b7        ,    b2         ,   b9    ]
    slot of pos p  =  block_table[p // block_size] * block_size + p % block_size

Full blocks are registered in the prefix cache when their tokens are scheduled; they are found again
by chained hash (see ``hashing``). A prefix hit stops at least one token short of the request's
known tokens, so the last token is always computed and yields logits.

The sliding-window layers' blocks are a second group (``window``: a ``WindowBlocks``, or ``NoWindow``
for a model without such layers, which holds nothing): each request has a window table beside its block
table, the same length, whose blocks out of the window go back to the window pool as the request goes on
(see ``kv.window_blocks``). A prefix hit is only as long as both groups can serve it. Loading blocks into
the pool (from the lower tier, from a prompt-cache file) is ``kv.block_loading``'s.
"""

from __future__ import annotations

from kvserve.kv import snapshot
from kvserve.kv.block_loading import BlockLoader, BlockSource, CacheableRequest, Lookup, LowerTier
from kvserve.kv.block_pool import BlockPool, BlockRef, KVBlock
from kvserve.kv.hashing import PROCESS_KEY, extend_block_hashes, window_part_hash
from kvserve.kv.snapshot import KVSnapshot
from kvserve.kv.window_blocks import NoWindow, WindowBlocks


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
        # the sliding-window layers' group, or one holding nothing
        self.window = window or NoWindow(block_size)
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
        self.loader = BlockLoader(self.pool, self.window, block_size)

    # --- lookup ---------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: CacheableRequest) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, as blocks and a token count (not yet referenced)."""
        if not self.enable_caching:
            return [], 0
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens, self.block_size, request.cache_salt, self.hash_key)
        hits = self._find(request, (len(tokens) - 1) // self.block_size)  # leave a token to compute
        if self.tier is not None:
            self.loader.load_window_parts(request, hits, self.tier)
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
        lookup = self._lookup(token_ids, salt)
        if self.tier is not None:
            self.loader.load_window_parts(lookup, blocks, self.tier)
        parts = ((i, self.loader.window_hit(lookup, blocks, i)) for i in range(len(blocks)))
        return [(i, b) for i, b in parts if b is not None]

    def block_hashes_of(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        return self._lookup(token_ids, salt).block_hashes

    def _lookup(self, token_ids: list[int], salt: str | None) -> Lookup:
        lookup = Lookup(list(token_ids), salt)
        extend_block_hashes(lookup.block_hashes, lookup.all_token_ids, self.block_size, salt, self.hash_key)
        return lookup

    def _find(self, request: CacheableRequest, max_blocks: int) -> list[KVBlock]:
        hits = self._pool_hits(request, [], max_blocks)
        if self.tier is not None and len(hits) < max_blocks and self._load_from_tier(
            request, hits, max_blocks):
            hits = self._pool_hits(request, hits, max_blocks)
        return hits

    def _pool_hits(self, request: CacheableRequest, hits: list[KVBlock], max_blocks: int) -> list[KVBlock]:
        """``hits`` extended by the blocks of the pool's cache that continue the request's chain."""
        hits = list(hits)
        bs = self.block_size
        for i in range(len(hits), max_blocks):
            chunk = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(request.block_hashes[i], chunk, hits[-1].ref if hits else None,
                                     request.cache_salt)
            if block is None:
                break
            hits.append(block)
        return hits

    def _load_from_tier(self, request: CacheableRequest, hits: list[KVBlock], max_blocks: int) -> int:
        """Load the blocks after ``hits`` that the lower tier holds into free blocks of the pool, and
        cache them there (as cached-free blocks, like any hit not taken yet). Returns how many."""
        count = self.loader.num_held(self.tier, request, len(hits), max_blocks)
        cached = self.loader.load(request, hits, count, self.tier)
        rid = request.request_id
        self._tier_tokens[rid] = self._tier_tokens.get(rid, 0) + cached * self.block_size
        return cached

    def install_prefix(self, token_ids: list[int], source: BlockSource, salt: str | None = None) -> int:
        """Cache the full blocks of ``token_ids`` that the pool lacks, loaded from ``source`` (a
        prompt-cache file), as far as the pool has room. Returns how many blocks of the prefix the
        pool now caches."""
        lookup = self._lookup(token_ids, salt)
        max_blocks = len(token_ids) // self.block_size
        hits = self._pool_hits(lookup, [], max_blocks)
        self.loader.load(lookup, hits, max_blocks - len(hits), source)
        hits = self._pool_hits(lookup, hits, max_blocks)
        self.loader.load_window_parts(lookup, hits, source)
        return self.window.reusable_prefix(hits, lookup.block_hashes, lookup.all_token_ids, salt)

    def record_prefix_lookup(self, request: CacheableRequest, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a blocked request's retries are not counted)."""
        self.prefix_queries += len(request.all_token_ids)
        self.prefix_hits += num_hit_tokens
        self.prefix_tier_hits += min(self._tier_tokens.pop(request.request_id, 0), num_hit_tokens)
        if self.tier is not None and num_hit_tokens:
            num_blocks = num_hit_tokens // self.block_size
            self.tier.touch(request.block_hashes[:num_blocks])
            first = self.window.first_live(num_hit_tokens)  # the window parts the next query reads
            if first < num_blocks:
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
        window = self.window
        window.release(rid, request.num_computed_tokens)  # always right: computed counts only grow
        window_hits = window.hit_blocks(computed_blocks, request.block_hashes, request.all_token_ids,
                                        request.cache_salt) if computed_blocks else []
        needed = window.blocks_needed(rid, num_computed, self.blocks_needed(total), len(computed_blocks))
        if needed > window.num_free_blocks - window.num_evictable(window_hits):
            return False
        window.allocate(rid, num_computed, self.blocks_needed(total), window_hits)
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
        extend_block_hashes(request.block_hashes, tokens[:num_tokens], self.block_size, request.cache_salt,
                            self.hash_key)
        blocks = self.req_blocks[request.request_id]
        start = self.num_cached_blocks[request.request_id]
        num_full = min(num_tokens, len(tokens)) // self.block_size  # speculative drafts are no tokens yet
        chain = self.chains.setdefault(request.request_id, [])
        for i in range(start, num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = chain[i - 1] if i else None
            chain.append(self.pool.cache_block(blocks[i], request.block_hashes[i], chunk, parent,
                                               request.cache_salt))
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
        self.window.free(request.request_id)

    # --- views ----------------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def window_block(self, request_id: str, index: int) -> KVBlock | None:
        """The request's window block ``index`` (None: out of the window, or no window group)."""
        return self.window.block(request_id, index)

    def window_block_ids(self, request_id: str) -> list[int] | None:
        """The request's window table (the null block where blocks fell out), or None without a window
        group."""
        return self.window.block_ids(request_id)

    def kv_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each KV group: every layer's, then (with one) the window group's."""
        window = self.window.block_ids(request_id)
        return [self.block_ids(request_id)] + ([] if window is None else [window])

    def snapshot(self, blocks: bool = False, tables: bool = False, cached: bool = False) -> KVSnapshot:
        """Every group read the same way, for views and the router (``kv.snapshot``); under the engine's
        lock."""
        return snapshot.take(self, blocks, tables, cached)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.window.reset_prefix_cache()
