"""BlockPool: exact free-queue order, reference counts and the prefix-cache index."""

from __future__ import annotations

import pytest

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import extend_block_hashes, hash_block
from tests.bookkeeping.kv_helpers import cached_ids, free_ids, ref_counts


def ids(blocks):
    return [b.block_id for b in blocks]


# --- hashing ------------------------------------------------------------------------------------------------
def test_hash_block_is_chained_and_salted():
    h0 = hash_block(None, (1, 2, 3, 4))
    assert 0 <= h0 < 2**128
    assert hash_block(None, (1, 2, 3, 4)) == h0  # deterministic within the process
    assert hash_block(None, (1, 2, 3, 4), "") != h0  # an empty salt is not no salt
    assert hash_block(None, (1, 2, 3, 4 + 2**16)) != h0  # every bit of a token id counts
    assert hash_block(None, (1, 2, 3, 5)) != h0
    assert hash_block(None, (1, 2, 3, 4), "salt") != h0
    # same block content under a different parent hashes differently
    assert hash_block(h0, (5, 6, 7, 8)) != hash_block(hash_block(None, (0, 2, 3, 4)), (5, 6, 7, 8))


def test_extend_block_hashes_only_full_blocks_and_incremental():
    hashes: list[int] = []
    extend_block_hashes(hashes, [1, 2, 3], 4)
    assert hashes == []  # a partial block gets no hash
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6], 4)
    h0 = hash_block(None, (1, 2, 3, 4))
    assert hashes == [h0]
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert hashes == [h0, hash_block(h0, (5, 6, 7, 8))]
    # already-hashed blocks are not recomputed (the list is only appended to)
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(hashes) == 2
    salted: list[int] = []
    extend_block_hashes(salted, [1, 2, 3, 4], 4, "s")
    assert salted == [hash_block(None, (1, 2, 3, 4), "s")] and salted != [h0]


# --- free queue order -----------------------------------------------------------------------------------
def test_initial_state():
    pool = BlockPool(8)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pool.num_free_blocks == 8
    assert pool.num_cached_free_blocks == 0
    assert ref_counts(pool) == [0] * 8
    assert all(b.block_hash is None and b.token_ids is None for b in pool.blocks)
    assert pool.cached == {}


def test_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_from_head():
    pool = BlockPool(8)
    first = pool.allocate(3)
    assert ids(first) == [0, 1, 2]
    assert [b.ref_count for b in first] == [1, 1, 1]
    assert free_ids(pool) == [3, 4, 5, 6, 7]
    assert ids(pool.allocate(2)) == [3, 4]
    assert free_ids(pool) == [5, 6, 7]
    assert ref_counts(pool) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.allocate(0) == []


def test_allocate_too_many_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate(4)
    assert free_ids(pool) == [1, 2, 3]
    assert ref_counts(pool) == [1, 0, 0, 0]


def test_free_order_determines_queue_order():
    pool = BlockPool(8)
    b = pool.allocate(4)  # 0..3
    pool.free([b[2], b[0]])
    assert free_ids(pool) == [4, 5, 6, 7, 2, 0]
    pool.free([b[3], b[1]])
    assert free_ids(pool) == [4, 5, 6, 7, 2, 0, 3, 1]
    # least recently freed first: the untouched blocks, then 2, 0, 3, 1
    assert ids(pool.allocate(7)) == [4, 5, 6, 7, 2, 0, 3]
    assert free_ids(pool) == [1]


def test_touch_shares_blocks_and_only_last_free_returns_them():
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    pool.touch([b0, b1])
    assert ref_counts(pool) == [2, 2, 0, 0]
    assert free_ids(pool) == [2, 3]
    pool.free([b1, b0])
    assert ref_counts(pool) == [1, 1, 0, 0]
    assert free_ids(pool) == [2, 3]  # still held by the other owner
    pool.free([b1])
    assert free_ids(pool) == [2, 3, 1]
    pool.free([b0])
    assert free_ids(pool) == [2, 3, 1, 0]
    assert ref_counts(pool) == [0, 0, 0, 0]


def test_touch_cached_free_block_pulls_it_out_of_queue():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    h = hash_block(None, (9, 9, 9, 9))
    pool.cache_block(blocks[1], h, (9, 9, 9, 9))
    pool.free(list(reversed(blocks)))
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    assert pool.num_cached_free_blocks == 1
    pool.touch([blocks[1]])
    assert blocks[1].ref_count == 1
    assert free_ids(pool) == [3, 4, 2, 0]  # the others keep their order
    assert pool.num_cached_free_blocks == 0
    assert pool.lookup(h, (9, 9, 9, 9)) is blocks[1]  # touching keeps the content
    pool.free([blocks[1]])
    assert free_ids(pool) == [3, 4, 2, 0, 1]  # rejoins at the tail


def test_double_free_asserts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free([b])
    assert free_ids(pool) == [1, 0]
    assert b.ref_count == 0


def test_double_free_within_one_call_asserts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b, b])


# --- prefix-cache index ---------------------------------------------------------------------------------
def test_cache_block_and_lookup_verifies_tokens():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    tokens = (1, 2, 3, 4)
    h = hash_block(None, tokens)
    pool.cache_block(b, h, tokens)
    assert b.block_hash == h and b.token_ids == tokens
    assert pool.cached == {h: b}
    assert pool.lookup(h, tokens) is b
    # a hash match whose tokens differ (a collision) is a miss
    assert pool.lookup(h, (1, 2, 3, 5)) is None
    assert pool.lookup(h, (1, 2, 3)) is None
    assert pool.lookup(h + 1, tokens) is None
    pool.free([b])


def test_cache_block_keeps_first_copy_of_same_content():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    tokens = (5, 6, 7, 8)
    h = hash_block(None, tokens)
    pool.cache_block(a, h, tokens)
    pool.cache_block(b, h, tokens)
    assert pool.cached == {h: a}
    assert b.block_hash is None and b.token_ids is None
    # evicting the unregistered duplicate must not drop the first copy from the index
    pool.free([b, a])
    assert free_ids(pool) == [2, 3, 1, 0]
    pool.allocate(3)  # 2, 3, 1
    assert pool.lookup(h, tokens) is a


def test_cache_block_does_not_rehash_a_registered_block():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h1, h2 = hash_block(None, (1, 1, 1, 1)), hash_block(None, (2, 2, 2, 2))
    pool.cache_block(b, h1, (1, 1, 1, 1))
    pool.cache_block(b, h2, (2, 2, 2, 2))
    assert b.block_hash == h1 and b.token_ids == (1, 1, 1, 1)
    assert pool.cached == {h1: b}


def test_cache_block_is_noop_when_caching_disabled():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    h = hash_block(None, (1, 2, 3, 4))
    pool.cache_block(b, h, (1, 2, 3, 4))
    assert b.block_hash is None and pool.cached == {}
    assert pool.lookup(h, (1, 2, 3, 4)) is None


def test_allocating_cached_free_block_evicts_its_hash():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)  # block 0
    tokens = (1, 2, 3, 4)
    h = hash_block(None, tokens)
    pool.cache_block(b, h, tokens)
    pool.free([b])
    assert free_ids(pool) == [1, 2, 3, 0]
    assert pool.num_cached_free_blocks == 1
    # the never-used blocks are taken first: the cached content survives
    assert ids(pool.allocate(3)) == [1, 2, 3]
    assert pool.lookup(h, tokens) is b
    # now the cached-free block is the only one left and gets evicted
    assert ids(pool.allocate(1)) == [0]
    assert b.block_hash is None and b.token_ids is None
    assert pool.cached == {}
    assert pool.lookup(h, tokens) is None
    assert pool.num_cached_free_blocks == 0


def test_reset_prefix_cache_drops_only_free_blocks():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hashes = [hash_block(None, (i,) * 4) for i in range(3)]
    for b, h, i in zip(blocks, hashes, range(3), strict=False):
        pool.cache_block(b, h, (i,) * 4)
    pool.free([blocks[2], blocks[0]])  # block 1 stays in use
    assert free_ids(pool) == [3, 2, 0]
    assert pool.num_cached_free_blocks == 2
    pool.reset_prefix_cache()
    assert cached_ids(pool) == [1]  # the in-use block keeps its content
    assert pool.lookup(hashes[1], (1,) * 4) is blocks[1]
    assert pool.lookup(hashes[0], (0,) * 4) is None
    assert blocks[0].block_hash is None and blocks[2].block_hash is None
    assert pool.num_cached_free_blocks == 0
    assert free_ids(pool) == [3, 2, 0]  # the queue order is untouched
    assert ref_counts(pool) == [0, 1, 0, 0]


def test_a_hit_must_follow_the_block_it_was_computed_after():
    """Equal hash and tokens are not enough: the block before must be the one the cached block was
    computed after (same id, same generation), and the salt the same."""
    pool = BlockPool(4)
    parent, child = pool.allocate(2)
    tokens = (5, 6, 7, 8)
    pool.cache_block(parent, 1, (1, 2, 3, 4))
    pool.cache_block(child, 2, tokens, parent.ref, "s")
    assert pool.lookup(2, tokens, parent.ref, "s") is child
    assert pool.lookup(2, tokens, parent.ref, None) is None
    assert pool.lookup(2, tokens, None, "s") is None
    other = pool.allocate(1)[0]
    assert pool.lookup(2, tokens, other.ref, "s") is None
    # the parent handed out again (new content): its old child is unreachable through it
    pool.free([parent])
    pool.allocate(2)  # takes block 3, then the freed parent
    assert parent.ref_count == 1 and pool.lookup(2, tokens, parent.ref, "s") is None


def test_uncached_blocks_cut_the_chain_after_them():
    pool = BlockPool(2)
    parent, child = pool.allocate(2)
    pool.cache_block(parent, 1, (1,))
    old_ref = parent.ref
    pool.cache_block(child, 2, (2,), old_ref)
    pool.uncache([parent])
    assert pool.lookup(1, (1,)) is None
    pool.cache_block(parent, 1, (1,))  # re-registered after recomputation: a new generation
    assert pool.lookup(2, (2,), parent.ref) is None and parent.ref != old_ref
