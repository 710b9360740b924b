"""The pool's KV event log: what a router outside the process learns of the prefix cache. Replaying the
events rebuilds the pool's set of cached hashes exactly; stores of one chain merge into one event."""

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, wire_hash
from kvserve.kv.hashing import hash_block

BS = 4


def _replay(events, known: set[int]) -> set[int]:
    for e in events:
        if isinstance(e, BlockStored):
            known.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            known.difference_update(e.block_hashes)
        else:
            known.clear()
    return known


def _chain(pool: BlockPool, blocks, tokens: list[int]) -> list[int]:
    hashes, parent, parent_hash = [], None, None
    for i, block in enumerate(blocks):
        chunk = tuple(tokens[i * BS : (i + 1) * BS])
        h = hash_block(parent_hash, chunk)
        parent = pool.cache_block(block, h, chunk, parent)
        hashes.append(h)
        parent_hash = h
    return hashes


def test_a_chain_is_one_stored_event_with_its_parent_and_tokens():
    pool = BlockPool(8)
    pool.events = KVEventLog()
    tokens = list(range(12))
    blocks = pool.allocate(3)
    hashes = _chain(pool, blocks, tokens)
    assert pool.events.take() == [BlockStored(hashes, None, tokens, BS, "CPU")]
    # a second request shares the first block and goes on elsewhere: its event names that parent
    other = pool.allocate(1)
    pool.touch(blocks[:1])
    h = hash_block(hashes[0], (9, 9, 9, 9))
    pool.cache_block(other[0], h, (9, 9, 9, 9), blocks[0].ref)
    assert pool.events.take() == [BlockStored([h], hashes[0], [9, 9, 9, 9], BS, "CPU")]
    pool.free(other + blocks[:1])
    pool.free(list(reversed(blocks)))


def test_evictions_uncaching_and_reset_replay_to_the_cached_set():
    pool = BlockPool(4)
    pool.events = KVEventLog()
    known: set[int] = set()
    a = pool.allocate(2)
    _chain(pool, a, [1, 2, 3, 4, 5, 6, 7, 8])
    pool.free(list(reversed(a)))
    b = pool.allocate(3)  # two free blocks, then the cached tail of a (freed first): one eviction
    _chain(pool, b, list(range(20, 32)))
    events = pool.events.take()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert _replay(events, known) == set(pool.cached)
    pool.uncache(b[2:])  # a failed step's block
    assert _replay(pool.events.take(), known) == set(pool.cached)
    pool.reset_prefix_cache()  # b is in use: its blocks stay cached, only a's head goes
    events = pool.events.take()
    assert [type(e) for e in events] == [BlockRemoved]
    assert _replay(events, known) == set(pool.cached) and len(known) == 2
    pool.free(list(reversed(b)))
    pool.reset_prefix_cache()
    assert pool.events.take() == [AllBlocksCleared()] and not pool.cached


def test_record_cached_lists_parents_before_children():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hashes = _chain(pool, blocks, list(range(12)))  # cached before anyone listened
    pool.events = KVEventLog("GPU")
    pool.record_cached()
    assert pool.events.take() == [BlockStored(hashes, None, list(range(12)), BS, "GPU")]
    pool.free(list(reversed(blocks)))


def test_wire_form_follows_vllm_field_order():
    h, p = (1 << 100) + 5, (1 << 64) + 7
    assert wire_hash(h) == 5 and wire_hash((1 << 64) - 1) == (1 << 64) - 1
    stored = BlockStored([h], p, [1, 2, 3, 4], BS, "CPU").to_wire()
    # tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
    assert stored == ["BlockStored", [5], 7, [1, 2, 3, 4], 4, None, "CPU", None]
    assert BlockRemoved([h], "CPU").to_wire() == ["BlockRemoved", [5], "CPU"]
    assert AllBlocksCleared().to_wire() == ["AllBlocksCleared"]
