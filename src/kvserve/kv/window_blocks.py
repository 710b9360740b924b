"""Blocks of the sliding-window layers: a pool of their own, freed as tokens fall out of the window.

A sliding layer's query at position p reads keys p - window + 1 .. p. Once a request has computed c
tokens, its queries are at c or later, so its sliding layers never read a block that ends before
c - window + 1 again. Such blocks go back to the window pool (cached-free, their hash kept) and the
request's window table points at the null block there instead:

    position      0 ..... 15 | 16 .... 31 | 32 .... 47 | 48 .. 52        window 24, computed c = 48
    full table    [   b3     ,    b9      ,    b4      ,   b7    ]       global layers: every block
    window table  [  null    ,    w5      ,    w2      ,   w8    ]       keys from 48 - 24 + 1 = 25 on

The null block (block 0 of the pool, zeros, never handed out) keeps a table's shape, so a slot is
``table[p // block_size] * block_size + p % block_size`` in either group; the attention kernels skip
keys outside the window (or mask them: zeros are harmless there).

Caching follows vLLM's hybrid manager: a full block of the window group is cached under the same
hash as the full group's block at that position and tied to it (its parent is that block's ref, not
the window block before it, which may be gone). A prefix of n blocks is reusable only when the full
group caches all n and the window group caches the blocks the next query reads
(``first_live(n * block_size)`` .. n - 1).
"""

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool, BlockRef, KVBlock

NULL_BLOCK = 0
WINDOW_KV_GROUP = 1  # the storage's KV group of the sliding-window layers (0: every other layer)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a window pool needs so that the sliding layers never run out before the global ones:
    per running sequence the blocks its window spans (one more where it straddles a boundary, one
    for the block being filled), plus the blocks of one step's new tokens (a step's token budget
    is shared by its sequences), plus the null block."""
    per_sequence = -(-window // block_size) + 2
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size) + 1


class WindowBlocks:
    """The sliding-window layers' group: a pool, and per request a window table beside its block table."""

    enabled = True

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a window pool needs the null block and at least one more")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.pool.touch([self.pool.blocks[NULL_BLOCK]])  # never handed out, never freed
        self.tables: dict[str, list[KVBlock | None]] = {}

    def first_live(self, num_computed: int) -> int:
        """The first block a request that computed ``num_computed`` tokens still reads."""
        return max(0, (num_computed - self.window + 1) // self.block_size)

    # --- lookup ---------------------------------------------------------------------------------------
    def reusable_prefix(self, hits: list[KVBlock], block_hashes: list[int], token_ids: list[int],
                        salt: str | None) -> int:
        """How many of the full group's prefix hits ``hits`` can be taken: the longest n whose window
        blocks (``first_live(n * block_size)`` .. n - 1) the window pool caches."""
        present = [self.lookup(i, hits, block_hashes, token_ids, salt) is not None for i in range(len(hits))]
        for n in range(len(hits), 0, -1):
            if all(present[self.first_live(n * self.block_size) : n]):
                return n
        return 0

    def lookup(self, i: int, hits: list[KVBlock], block_hashes: list[int], token_ids: list[int],
               salt: str | None) -> KVBlock | None:
        """The cached window block of position ``i``, tied to the full group's block ``hits[i]``."""
        bs = self.block_size
        return self.pool.lookup(block_hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]), hits[i].ref, salt)

    def hit_blocks(self, hits: list[KVBlock], block_hashes: list[int], token_ids: list[int],
                   salt: str | None) -> list[KVBlock]:
        """The window blocks a hit of ``hits`` reads (see ``reusable_prefix``), first to last."""
        first = self.first_live(len(hits) * self.block_size)
        return [self.lookup(i, hits, block_hashes, token_ids, salt) for i in range(first, len(hits))]

    # --- allocation -----------------------------------------------------------------------------------
    def blocks_needed(self, request_id: str, num_computed: int, num_blocks: int, num_hits: int = 0) -> int:
        """New blocks a request needs for a table of ``num_blocks`` after computing ``num_computed``
        tokens (``num_hits``: blocks being taken as a prefix hit now)."""
        table = self.tables.get(request_id, [])
        start = max(len(table) + num_hits, self.first_live(num_computed))
        return max(0, num_blocks - start)

    def allocate(self, request_id: str, num_computed: int, num_blocks: int,
                 hit_blocks: list[KVBlock] | None = None) -> None:
        """Release what fell out of the window, take ``hit_blocks`` (the window blocks of a prefix hit
        on an empty table, ending at block ``num_computed // block_size``), and grow the table to
        ``num_blocks`` entries. The caller checked ``blocks_needed`` against ``num_free_blocks``."""
        table = self.tables.setdefault(request_id, [])
        first = self.first_live(num_computed)
        if hit_blocks:
            assert not table
            self.pool.touch(hit_blocks)
            table.extend([None] * (num_computed // self.block_size - len(hit_blocks)))
            table.extend(hit_blocks)
        self.release(request_id, num_computed)
        table.extend([None] * (first - len(table)))
        if num_blocks > len(table):
            table.extend(self.pool.allocate(num_blocks - len(table)))

    def release(self, request_id: str, num_computed: int) -> None:
        """Give back the request's blocks that end before what its next query reads, oldest first."""
        table = self.tables.get(request_id, [])
        dead = [b for b in table[: self.first_live(num_computed)] if b is not None]
        for i in range(min(len(table), self.first_live(num_computed))):
            table[i] = None
        self.pool.free(dead)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_evictable(self, blocks: list[KVBlock]) -> int:
        return sum(1 for b in blocks if b.ref_count == 0)

    # --- caching --------------------------------------------------------------------------------------
    def cache_block(self, request_id: str, index: int, block_hash: int, token_ids: tuple[int, ...],
                    full_ref: BlockRef, salt: str | None) -> None:
        """Register the request's window block ``index``, tied to the full group's block ``full_ref``."""
        table = self.tables.get(request_id, [])
        if index < len(table) and table[index] is not None:
            self.pool.cache_block(table[index], block_hash, token_ids, full_ref, salt)

    def forget_from(self, request_id: str, first: int) -> None:
        """Blocks from ``first`` on hold no computed tokens: out of the cache."""
        self.pool.uncache([b for b in self.tables.get(request_id, [])[first:] if b is not None])

    def block(self, request_id: str, index: int) -> KVBlock | None:
        table = self.tables.get(request_id, [])
        return table[index] if index < len(table) else None

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first."""
        table = self.tables.pop(request_id, [])
        self.pool.free([b for b in reversed(table) if b is not None])

    # --- views ----------------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK if b is None else b.block_id for b in self.tables.get(request_id, [])]

    def num_held_blocks(self) -> int:
        """Blocks held by requests (the null block not counted)."""
        return self.pool.num_blocks - self.pool.num_free_blocks - 1

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()


class NoWindow:
    """The window group of a model without sliding-window layers: it holds nothing, so every prefix the
    full group caches is whole, and the manager needs no branch for it. ``WindowBlocks``' interface."""

    enabled = False
    window = 0

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def first_live(self, num_computed: int) -> int:
        return num_computed // self.block_size  # no window parts to read: the live range is empty

    def reusable_prefix(self, hits: list[KVBlock], block_hashes: list[int], token_ids: list[int],
                        salt: str | None) -> int:
        return len(hits)

    def lookup(self, i: int, hits: list[KVBlock], block_hashes: list[int], token_ids: list[int],
               salt: str | None) -> KVBlock | None:
        return None

    def hit_blocks(self, hits: list[KVBlock], block_hashes: list[int], token_ids: list[int],
                   salt: str | None) -> list[KVBlock]:
        return []

    def blocks_needed(self, request_id: str, num_computed: int, num_blocks: int, num_hits: int = 0) -> int:
        return 0

    def allocate(self, request_id: str, num_computed: int, num_blocks: int,
                 hit_blocks: list[KVBlock] | None = None) -> None:
        pass

    def release(self, request_id: str, num_computed: int) -> None:
        pass

    num_free_blocks = 0

    def num_evictable(self, blocks: list[KVBlock]) -> int:
        return 0

    def cache_block(self, request_id: str, index: int, block_hash: int, token_ids: tuple[int, ...],
                    full_ref: BlockRef, salt: str | None) -> None:
        pass

    def forget_from(self, request_id: str, first: int) -> None:
        pass

    def block(self, request_id: str, index: int) -> KVBlock | None:
        return None

    def free(self, request_id: str) -> None:
        pass

    def block_ids(self, request_id: str) -> list[int] | None:
        return None

    def num_held_blocks(self) -> int:
        return 0

    def reset_prefix_cache(self) -> None:
        pass
