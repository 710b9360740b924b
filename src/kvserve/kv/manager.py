"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request's block table is append-only while it runs:

    token positions   0 ........ 15 | 16 ....... 31 | 32 .. 40
    block table       [   b7        ,    b2         ,   b9    ]
    slot of pos p  =  block_table[p // block_size] * block_size + p % block_size

Full blocks are registered in the prefix cache when their tokens are scheduled; they are found again
by chained hash (see ``hashing``). A prefix hit stops at least one token short of the request's
known tokens, so the last token is always computed and yields logits.

The layers' blocks are in KV groups (``kv.groups``): the full group (every layer), and for a model with
sliding-window layers a window group whose blocks go back to its pool as they fall out of the window.
The manager asks each group the same questions: a prefix hit is only as long as every group can serve
it, a step is admitted only when every group has room, and a request's blocks are released, registered,
forgotten and freed group by group. Loading blocks into the pools (from the lower tier, from a
prompt-cache file) is ``kv.block_loading``'s.
"""

from __future__ import annotations

from kvserve.kv import snapshot
from kvserve.kv.block_loading import BlockLoader, BlockSource, CacheableRequest, Lookup, LowerTier
from kvserve.kv.block_pool import BlockRef, KVBlock
from kvserve.kv.groups import FullGroup, KVGroup
from kvserve.kv.hashing import PROCESS_KEY, extend_block_hashes
from kvserve.kv.snapshot import KVSnapshot


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_key: bytes = PROCESS_KEY,
        tier: LowerTier | None = None,
        more_groups: tuple[KVGroup, ...] = (),
    ) -> None:
        """``num_blocks``: the full group's pool; ``more_groups``: the groups of layers that keep fewer
        blocks (a ``WindowGroup`` for sliding-window layers)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_key = hash_key
        self.tier = tier if enable_caching else None
        # the full group first: the prefix cache's chain runs through its blocks (``kv.groups``)
        self.full = FullGroup(0, num_blocks, block_size, enable_caching)
        self.tied = tuple(more_groups)  # their cached blocks hang from the full group's
        self.groups: tuple[KVGroup, ...] = (self.full, *self.tied)
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are registered
        # per request, the cached block each registered position continues from (see cache_block)
        self.chains: dict[str, list[BlockRef]] = {}
        self.num_saved_blocks: dict[str, int] = {}  # how many of a request's blocks the lower tier was given
        self.prefix_queries = 0  # tokens looked up by admitted requests
        self.prefix_hits = 0  # of which found in the cache
        self.prefix_tier_hits = 0  # of which loaded from the lower tier
        self._tier_tokens: dict[str, int] = {}  # per waiting request: tokens its lookups loaded
        self.loader = BlockLoader(self.full.pool, block_size)

    # --- lookup ---------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: CacheableRequest) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, as blocks and a token count (not yet referenced)."""
        if not self.enable_caching:
            return [], 0
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens, self.block_size, request.cache_salt, self.hash_key)
        hits = self._find(request, (len(tokens) - 1) // self.block_size)  # leave a token to compute
        if self.tier is not None:
            self._load_parts(request, hits, self.tier)
        hits = hits[: self.reusable_prefix(hits, request)]
        return hits, len(hits) * self.block_size

    def reusable_prefix(self, hits: list[KVBlock], request: CacheableRequest) -> int:
        """How many of the full group's hits ``hits`` every group can serve."""
        return min(group.reusable_prefix(hits, request) for group in self.groups)

    def _load_parts(self, request: CacheableRequest, hits: list[KVBlock], source: BlockSource) -> None:
        for group in self.tied:
            self.loader.load_parts(group, request, hits, source)

    def cached_prefix(self, token_ids: list[int], salt: str | None = None) -> list[KVBlock]:
        """The cached blocks (pool, then lower tier) holding the full blocks of ``token_ids``, as far as
        the chain goes. Not referenced: use them before the next allocation."""
        lookup = self.lookup(token_ids, salt)
        hits = self._find(lookup, len(token_ids) // self.block_size)
        self._tier_tokens.pop(lookup.request_id, None)
        return hits

    def cached_parts(self, token_ids: list[int], blocks: list[KVBlock],
                     salt: str | None = None) -> list[list[tuple[int, KVBlock]]]:
        """Per group, (position, block) of its cached parts of ``blocks`` (``cached_prefix``'s answer),
        after loading from the lower tier those a query after all of them reads. Not referenced: use
        them before the next allocation."""
        lookup = self.lookup(token_ids, salt)
        if self.tier is not None:
            self._load_parts(lookup, blocks, self.tier)
        found = []
        for group in self.groups:
            parts = ((i, group.part(i, blocks, lookup)) for i in range(len(blocks)))
            found.append([(i, b) for i, b in parts if b is not None])
        return found

    def block_hashes_of(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        return self.lookup(token_ids, salt).block_hashes

    def lookup(self, token_ids: list[int], salt: str | None = None) -> Lookup:
        """``token_ids`` as a lookup that is no request's (saving or loading a prompt cache), hashed."""
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
            block = self.full.pool.lookup(request.block_hashes[i], chunk, hits[-1].ref if hits else None,
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
        lookup = self.lookup(token_ids, salt)
        max_blocks = len(token_ids) // self.block_size
        hits = self._pool_hits(lookup, [], max_blocks)
        self.loader.load(lookup, hits, max_blocks - len(hits), source)
        hits = self._pool_hits(lookup, hits, max_blocks)
        self._load_parts(lookup, hits, source)
        return self.reusable_prefix(hits, lookup)

    def record_prefix_lookup(self, request: CacheableRequest, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a blocked request's retries are not counted)."""
        self.prefix_queries += len(request.all_token_ids)
        self.prefix_hits += num_hit_tokens
        self.prefix_tier_hits += min(self._tier_tokens.pop(request.request_id, 0), num_hit_tokens)
        if self.tier is not None and num_hit_tokens:
            num_blocks = num_hit_tokens // self.block_size
            for group in self.groups:  # the parts the next query reads
                first = group.first_live(num_hit_tokens)
                if first < num_blocks:
                    parts = [group.part_hash(h) for h in request.block_hashes[first:num_blocks]]
                    self.tier.touch(parts, first)

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
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_blocks = self.blocks_needed(total)
        hits = []
        for group in self.groups:
            group.release(rid, request.num_computed_tokens)  # always right: computed counts only grow
            hits.append(group.hit_blocks(computed_blocks, request) if computed_blocks else [])
            needed = group.blocks_needed(rid, num_computed, num_blocks, len(computed_blocks))
            if needed > group.num_free_blocks - group.num_evictable(hits[-1]):
                return False
        for group, group_hits in zip(self.groups, hits, strict=True):
            group.allocate(rid, num_computed, num_blocks, group_hits)
        if computed_blocks:  # prefix hits are taken only when the table is still empty
            self.num_cached_blocks[rid] = len(computed_blocks)
            self.num_saved_blocks[rid] = len(computed_blocks)  # cached: saved when computed
            self.chains[rid] = [b.ref for b in computed_blocks]
        self.num_cached_blocks.setdefault(rid, 0)
        self._cache_full_blocks(request, total)
        return True

    def _cache_full_blocks(self, request: CacheableRequest, num_tokens: int) -> None:
        """Register the blocks that are full once ``num_tokens`` tokens are computed."""
        if not self.enable_caching:
            return
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens[:num_tokens], self.block_size, request.cache_salt,
                            self.hash_key)
        rid, hashes, salt = request.request_id, request.block_hashes, request.cache_salt
        start = self.num_cached_blocks[rid]
        num_full = min(num_tokens, len(tokens)) // self.block_size  # speculative drafts are no tokens yet
        chain = self.chains.setdefault(rid, [])
        for i in range(start, num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            # the chain: each full block hangs from the one before; the other groups' from the full one
            chain.append(self.full.cache_block(rid, i, hashes[i], chunk, chain[i - 1] if i else None, salt))
            for group in self.tied:
                group.cache_block(rid, i, hashes[i], chunk, chain[i], salt)
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def unsaved_parts(self, request: CacheableRequest) -> list[list[tuple[int, KVBlock]]]:
        """Per group, (position, block) of its parts of the request's cached blocks whose tokens are all
        computed and that the lower tier was not given yet; they count as given from now on. A block
        whose content the pool cached under another block is left out (that one was given)."""
        rid = request.request_id
        first = self.num_saved_blocks.get(rid, 0)
        last = min(self.num_cached_blocks.get(rid, 0), request.num_computed_tokens // self.block_size)
        self.num_saved_blocks[rid] = max(first, last)
        table = self.full.tables.get(rid, [])
        positions = [i for i in range(first, last) if table[i].block_hash == request.block_hashes[i]]
        found = []
        for group in self.groups:
            parts = ((i, group.block(rid, i)) for i in positions)
            found.append([(i, b) for i, b in parts if b is not None])
        return found

    def forget_uncomputed(self, request: CacheableRequest) -> None:
        """Take the request's blocks from its first not-yet-computed token on out of the prefix cache
        (they were registered when scheduled, before a forward that did not happen)."""
        rid = request.request_id
        first = request.num_computed_tokens // self.block_size
        for group in self.groups:
            group.forget_from(rid, first)
        kept = min(self.num_cached_blocks.get(rid, 0), first)
        self.num_cached_blocks[rid] = kept
        del self.chains.setdefault(rid, [])[kept:]

    def free(self, request: CacheableRequest) -> None:
        """Release every block of the request, tail first (so tail blocks are evicted first)."""
        rid = request.request_id
        for state in (self.num_cached_blocks, self.num_saved_blocks, self._tier_tokens, self.chains):
            state.pop(rid, None)
        for group in self.groups:
            group.free(rid)

    # --- views ----------------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table in the full group."""
        return self.full.block_ids(request_id)

    def kv_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each KV group, in the storage's group order."""
        return [group.block_ids(request_id) for group in self.groups]

    def snapshot(self, blocks: bool = False, tables: bool = False, cached: bool = False) -> KVSnapshot:
        """Every group read the same way, for views and the router (``kv.snapshot``); under the engine's
        lock."""
        return snapshot.take(self, blocks, tables, cached)

    @property
    def num_blocks(self) -> int:
        return self.full.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of the full group's blocks held by requests (cached-free blocks count as free)."""
        return 1.0 - self.full.num_free_blocks / self.num_blocks

    def reset_prefix_cache(self) -> None:
        for group in self.groups:
            group.reset_prefix_cache()
