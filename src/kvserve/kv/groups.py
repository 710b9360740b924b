"""KV groups: the layers whose blocks are allocated together, each a pool of its own with a block table
per request. Every layer is in the full group; a model with sliding-window layers (Gemma 3) puts
those in a window group, whose blocks go back to its pool as tokens fall out of the window.

The manager (``kv.manager``) asks every group the same questions (what a prefix hit takes from it, how
many blocks a step needs, what to release, free, register and forget); the groups answer in their own
way, as vLLM's per-attention-type managers do behind its coordinator. Two things set the full group
apart, and both are the prefix cache's: block hashes chain through its blocks (a hit is found by
walking its cache), and a cached block of any other group is tied to the full group's block at the same
position (its parent is that block's ref, not the block before it, which may be gone).

A sliding layer's query at position p reads keys p - window + 1 .. p. Once a request has computed c
tokens, its queries are at c or later, so its sliding layers never read a block that ends before
c - window + 1 again. Such blocks go back to the window pool (cached-free, their hash kept) and the
request's window table points at the null block there instead:

    position      0 ..... 15 | 16 .... 31 | 32 .... 47 | 48 .. 52        window 24, computed c = 48
    full table    [   b3     ,    b9      ,    b4      ,   b7    ]       global layers: every block
    window table  [  null    ,    w5      ,    w2      ,   w8    ]       keys from 48 - 24 + 1 = 25 on

The null block (block 0 of the window pool, zeros, never handed out) keeps a table's shape, so a slot is
``table[p // block_size] * block_size + p % block_size`` in either group; the attention kernels skip
keys outside the window (or mask them: zeros are harmless there). A prefix of n blocks is reusable
only when every group caches the blocks the next query reads from it (``first_live(n * block_size)``
.. n - 1): all n for the full group, the last window's for the window group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.kv.block_pool import BlockPool, BlockRef, KVBlock
from kvserve.kv.hashing import window_part_hash
from kvserve.kv.snapshot import FULL, WINDOW, KVGroupSnapshot

if TYPE_CHECKING:
    from kvserve.kv.block_loading import CacheableRequest
    from kvserve.kv.disk_tier import BlockKey

NULL_BLOCK = 0


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a window pool needs so that the sliding layers never run out before the global ones:
    per running sequence the blocks its window spans (one more where it straddles a boundary, one
    for the block being filled), plus the blocks of one step's new tokens (a step's token budget
    is shared by its sequences), plus the null block."""
    per_sequence = -(-window // block_size) + 2
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size) + 1


def _states(blocks: list[KVBlock]) -> list[int]:
    return [b.ref_count or -(b.block_hash is not None) for b in blocks]


class KVGroup:
    """What every group does the same way: its pool, and per request a table of its blocks (None where a
    block fell out of what the group's layers read). Subclasses say which blocks a request still reads
    (``first_live``) and which cached block serves a prefix's position (``part``)."""

    name: str
    window: int | None = None  # tokens a layer of the group reads back; None: every token
    reserved = 0  # blocks of the pool never handed out (the window pool's null block)

    def __init__(self, kv_group: int, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.kv_group = kv_group  # the storage's group of these layers (``PagedKVStorage``)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[KVBlock | None]] = {}
        self.released: dict[str, int] = {}  # per request, how many of its table's first entries are None

    # --- what sets a group apart -----------------------------------------------------------------------
    def first_live(self, num_computed: int) -> int:
        """The first block a request that computed ``num_computed`` tokens still reads in this group."""
        raise NotImplementedError

    def part(self, index: int, hits: list[KVBlock], request: CacheableRequest) -> KVBlock | None:
        """This group's cached block for position ``index`` of the request's prefix, whose full-group
        blocks are ``hits``; None where the group caches none."""
        raise NotImplementedError

    def part_hash(self, block_hash: int) -> int:
        """The name the part of the block ``block_hash`` has in a lower tier."""
        raise NotImplementedError

    def part_key(self, key: BlockKey) -> BlockKey:
        """The lower tier's key of the part of the block ``key``."""
        raise NotImplementedError

    # --- lookup ---------------------------------------------------------------------------------------
    def reusable_prefix(self, hits: list[KVBlock], request: CacheableRequest) -> int:
        """How many of the full group's prefix hits ``hits`` this group can serve: the longest n whose
        blocks ``first_live(n * block_size)`` .. n - 1 it caches."""
        present: dict[int, bool] = {}
        for n in range(len(hits), 0, -1):
            live = range(self.first_live(n * self.block_size), n)
            if all(present.setdefault(i, self.part(i, hits, request) is not None) for i in live):
                return n
        return 0

    def hit_blocks(self, hits: list[KVBlock], request: CacheableRequest) -> list[KVBlock]:
        """This group's blocks a hit of ``hits`` reads (see ``reusable_prefix``), first to last."""
        first = self.first_live(len(hits) * self.block_size)
        return [self.part(i, hits, request) for i in range(first, len(hits))]

    # --- allocation -----------------------------------------------------------------------------------
    def blocks_needed(self, request_id: str, num_computed: int, num_blocks: int, num_hits: int = 0) -> int:
        """New blocks a request needs for a table of ``num_blocks`` after computing ``num_computed``
        tokens (``num_hits``: blocks being taken as a prefix hit now)."""
        table = self.tables.get(request_id, [])
        start = max(len(table) + num_hits, self.first_live(num_computed))
        return max(0, num_blocks - start)

    def allocate(self, request_id: str, num_computed: int, num_blocks: int,
                 hit_blocks: list[KVBlock] | None = None) -> None:
        """Release what the request no longer reads, take ``hit_blocks`` (this group's blocks of a prefix
        hit on an empty table, ending at block ``num_computed // block_size``), and grow the table to
        ``num_blocks`` entries. The caller checked ``blocks_needed`` against ``num_free_blocks``."""
        table = self.tables.setdefault(request_id, [])
        if hit_blocks:
            assert not table
            self.pool.touch(hit_blocks)
            table.extend([None] * (num_computed // self.block_size - len(hit_blocks)))
            table.extend(hit_blocks)
        self.release(request_id, num_computed)
        table.extend([None] * (self.first_live(num_computed) - len(table)))
        if num_blocks > len(table):
            table.extend(self.pool.allocate(num_blocks - len(table)))

    def release(self, request_id: str, num_computed: int) -> None:
        """Give back the request's blocks that end before what its next query reads, oldest first."""
        table = self.tables.get(request_id, [])
        start, first = self.released.get(request_id, 0), min(len(table), self.first_live(num_computed))
        if first <= start:  # every step asks: most have nothing to give back
            return
        dead = [b for b in table[start:first] if b is not None]
        table[start:first] = [None] * (first - start)
        self.released[request_id] = first
        self.pool.free(dead)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_evictable(self, blocks: list[KVBlock]) -> int:
        """How many of ``blocks`` are cached-free: they leave the free queue when taken, so they do not
        count as room."""
        return sum(1 for b in blocks if b.ref_count == 0)

    # --- caching --------------------------------------------------------------------------------------
    def cache_block(self, request_id: str, index: int, block_hash: int, token_ids: tuple[int, ...],
                    parent: BlockRef | None, salt: str | None) -> BlockRef | None:
        """Register the request's block ``index`` under ``block_hash``, hung from ``parent``; the ref the
        pool holds that content under (another block's where it was cached already), None where the
        table has no block there."""
        table = self.tables.get(request_id, [])
        if index < len(table) and table[index] is not None:
            return self.pool.cache_block(table[index], block_hash, token_ids, parent, salt)
        return None

    def forget_from(self, request_id: str, first: int) -> None:
        """Blocks from ``first`` on hold no computed tokens: out of the cache."""
        self.pool.uncache([b for b in self.tables.get(request_id, [])[first:] if b is not None])

    def block(self, request_id: str, index: int) -> KVBlock | None:
        table = self.tables.get(request_id, [])
        return table[index] if index < len(table) else None

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (so tail blocks are evicted first)."""
        table = self.tables.pop(request_id, [])
        self.released.pop(request_id, None)
        self.pool.free([b for b in reversed(table) if b is not None])

    # --- views ----------------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The request's table as block ids (the null block where blocks fell out)."""
        return [NULL_BLOCK if b is None else b.block_id for b in self.tables.get(request_id, [])]

    def num_held_blocks(self) -> int:
        """Blocks held by requests (reserved blocks not counted)."""
        return self.pool.num_blocks - self.pool.num_free_blocks - self.reserved

    def snapshot(self, blocks: bool, tables: bool) -> KVGroupSnapshot:
        pool = self.pool
        snap = KVGroupSnapshot(self.name, self.kv_group, self.window, pool.num_blocks, pool.num_free_blocks,
                               self.num_held_blocks())
        if blocks:
            snap.block_states = _states(pool.blocks[self.reserved :])
        if tables:
            snap.tables = {rid: self.block_ids(rid) for rid in list(self.tables)}
        return snap

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()


class FullGroup(KVGroup):
    """Every layer that reads every token: a request reads all its blocks, and the prefix cache's chain
    runs through them (a hit's blocks are this group's own)."""

    name = FULL

    def first_live(self, num_computed: int) -> int:
        return 0

    def part(self, index: int, hits: list[KVBlock], request: CacheableRequest) -> KVBlock | None:
        return hits[index]

    def part_hash(self, block_hash: int) -> int:
        return block_hash

    def part_key(self, key: BlockKey) -> BlockKey:
        return key


class WindowGroup(KVGroup):
    """The sliding-window layers: a request reads only its last window's blocks. Block 0 of the pool is
    the null block, which tables point at where blocks fell out."""

    name = WINDOW
    reserved = 1

    def __init__(self, kv_group: int, num_blocks: int, block_size: int, window: int,
                 enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a window pool needs the null block and at least one more")
        super().__init__(kv_group, num_blocks, block_size, enable_caching)
        self.window = window
        self.pool.touch([self.pool.blocks[NULL_BLOCK]])  # never handed out, never freed

    def first_live(self, num_computed: int) -> int:
        return max(0, (num_computed - self.window + 1) // self.block_size)

    def part(self, index: int, hits: list[KVBlock], request: CacheableRequest) -> KVBlock | None:
        bs = self.block_size
        return self.pool.lookup(request.block_hashes[index],
                                tuple(request.all_token_ids[index * bs : (index + 1) * bs]), hits[index].ref,
                                request.cache_salt)

    def part_hash(self, block_hash: int) -> int:
        return window_part_hash(block_hash)

    def part_key(self, key: BlockKey) -> BlockKey:
        return key.window_part()
