"""A fixed pool of KV blocks with reference counts and an LRU queue of free blocks.

A block is in exactly one of three states:

    in use        ref_count > 0                       owned by one or more requests
    cached-free   ref_count == 0, block_hash set      in the free queue, content still valid
    free          ref_count == 0, block_hash None     in the free queue

Allocation takes blocks from the head of the free queue (least recently freed first) and evicts
their cached content. A prefix-cache hit on a cached-free block pulls it out of the queue.
Pure bookkeeping: no tensors live here.

A cached block's K/V depend on every token before it. So a hit must match the whole chain, not only
its own hash and tokens: each cached block records which block (id and generation: a block's
generation changes whenever it is handed out again) held the tokens before it when it was computed,
and a lookup accepts it only after that very block. Even colliding hashes then cannot serve K/V
computed under another prefix.

With ``events`` set (a ``KVEventLog``), every hash the cache gains or loses is recorded there, for
routers outside the process (see ``kv.events``); None, the default, records nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.kv.events import KVEventLog
from kvserve.kv.hashing import BlockHash

BlockRef = tuple[int, int]  # (block id, generation): one filling of one block


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # kept with the hash so a cache hit can be verified: the tokens, the block before, the salt
    token_ids: tuple[int, ...] | None = None
    parent: BlockRef | None = None
    salt: str | None = None
    generation: int = 0

    @property
    def ref(self) -> BlockRef:
        return (self.block_id, self.generation)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus cached-free)."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    def lookup(
        self,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        parent: BlockRef | None = None,
        salt: str | None = None,
    ) -> KVBlock | None:
        """The cached block for this position of a chain whose previous block is ``parent``."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent != parent or block.salt != salt:
            return None
        return block

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            assert block.ref_count == 0
            block.ref_count = 1
            block.generation += 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference on each block, in the given order; blocks reaching zero join the queue's
        tail, so the first ones freed are the first ones evicted. Callers pass a request's blocks
        in reverse so that tail blocks (least likely to be shared) go first."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        parent: BlockRef | None = None,
        salt: str | None = None,
    ) -> BlockRef:
        """Register ``block``, computed after ``parent``. Returns the block the chain goes on from:
        ``block``, or the first copy when the same content (same tokens after the same parent) was
        cached already, so that the blocks after it stay reachable."""
        if not self.enable_caching or block.block_hash is not None:
            return block.ref
        first = self.cached.get(block_hash)
        if first is not None:
            same = first.token_ids == token_ids and first.parent == parent and first.salt == salt
            return first.ref if same else block.ref
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent = parent
        block.salt = salt
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, self.hash_of(parent), token_ids)
        return block.ref

    def hash_of(self, ref: BlockRef | None) -> BlockHash | None:
        """The hash of the block ``ref`` names, while that filling is cached (else None)."""
        if ref is None:
            return None
        block = self.blocks[ref[0]]
        return block.block_hash if block.generation == ref[1] else None

    def uncache(self, blocks: list[KVBlock]) -> None:
        """Blocks whose content is not what their hash says: no later lookup may find them, nor a
        block cached after them."""
        for block in blocks:
            self._evict(block)
            block.generation += 1

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = None
            block.parent = None
            block.salt = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (blocks in use stay cached)."""
        for block in self.free_queue.values():
            self._evict(block)
        if self.events is not None and not self.cached:
            self.events.cleared()

    def record_cached(self) -> None:
        """Record every block cached now as stored (for a subscriber that starts after them).
        ``cached`` keeps insertion order, and a block is registered only after its parent, so
        parents come before their children."""
        if self.events is not None:
            for block_hash, block in self.cached.items():
                self.events.stored(block_hash, self.hash_of(block.parent), block.token_ids)
