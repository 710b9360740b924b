"""KVCacheManager: block tables, automatic prefix caching and eviction order (block_size 4)."""

from __future__ import annotations

import pytest

from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.hashing import hash_block
from tests.bookkeeping.kv_helpers import (
    cached_ids,
    free_ids,
    leak_report,
    make_request,
    manager_snapshot,
    ref_counts,
)


def ids(blocks):
    return [b.block_id for b in blocks]


def prefill(kv, request):
    """Look up the prefix cache and allocate the whole rest of the prompt, as one step would."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit_tokens


def decode_one(kv, request, token):
    """Append a sampled token and allocate its slot (the token is computed in the next step)."""
    request.append_token(token)
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1


# --- allocation and free order --------------------------------------------------------------------------
def test_allocate_ten_token_prompt(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(10))
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    assert ref_counts(kv.full.pool) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert free_ids(kv.full.pool) == [3, 4, 5, 6, 7, 8, 9]
    # the two full blocks are registered, the partial tail (tokens 8, 9) is not
    assert cached_ids(kv.full.pool) == [0, 1]
    blocks = kv.full.pool.blocks
    assert blocks[0].token_ids == (0, 1, 2, 3)
    assert blocks[1].token_ids == (4, 5, 6, 7)
    assert blocks[2].block_hash is None and blocks[2].token_ids is None
    h0 = hash_block(None, (0, 1, 2, 3))
    assert a.block_hashes == [h0, hash_block(h0, (4, 5, 6, 7))]
    assert blocks[0].block_hash == h0
    assert kv.num_cached_blocks == {"a": 2}
    assert kv.usage == pytest.approx(0.3)
    kv.free(a)


def test_free_releases_tail_first(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(10))
    prefill(kv, a)
    kv.free(a)
    assert free_ids(kv.full.pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert ref_counts(kv.full.pool) == [0] * 10
    assert kv.full.tables == {} and kv.num_cached_blocks == {}
    assert kv.full.pool.num_cached_free_blocks == 2
    assert kv.usage == 0.0  # cached-free blocks count as free


def test_tail_blocks_are_evicted_first_and_the_prefix_survives(make_manager):
    kv = make_manager(6)
    a = make_request("a", range(12))  # three full blocks
    prefill(kv, a)
    assert cached_ids(kv.full.pool) == [0, 1, 2]
    kv.free(a)
    assert free_ids(kv.full.pool) == [3, 4, 5, 2, 1, 0]
    other = make_request("other", range(100, 116))
    prefill(kv, other)
    assert kv.block_ids("other") == [3, 4, 5, 2]  # took a's tail block, not its prefix
    assert free_ids(kv.full.pool) == [1, 0]
    again = make_request("again", list(range(12)) + [12])
    hits, n = kv.get_computed_blocks(again)
    assert (ids(hits), n) == ([0, 1], 8)
    kv.free(other)


def test_free_unknown_request_is_noop(make_manager):
    kv = make_manager(4)
    kv.free(make_request("ghost", [1, 2, 3]))
    assert free_ids(kv.full.pool) == [0, 1, 2, 3]


# --- prefix hits ----------------------------------------------------------------------------------------
def test_second_request_with_same_prefix_gets_hits(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(10))
    prefill(kv, a)
    kv.free(a)  # free queue: [3..9, 2, 1, 0]

    b = make_request("b", list(range(8)) + [100, 101])
    hits, n = kv.get_computed_blocks(b)
    assert (ids(hits), n) == ([0, 1], 8)
    # a lookup alone takes no reference
    assert ref_counts(kv.full.pool) == [0] * 10
    assert free_ids(kv.full.pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    assert kv.allocate_slots(b, 2, hits)
    b.num_computed_tokens = 10
    assert kv.block_ids("b") == [0, 1, 3]
    assert ref_counts(kv.full.pool) == [1, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert free_ids(kv.full.pool) == [4, 5, 6, 7, 8, 9, 2]
    assert kv.num_cached_blocks == {"b": 2}

    # a third request shares the same two blocks while b still holds them
    c = make_request("c", list(range(8)) + [200])
    hits, n = kv.get_computed_blocks(c)
    assert (ids(hits), n) == ([0, 1], 8)
    assert kv.allocate_slots(c, 1, hits)
    assert kv.block_ids("c") == [0, 1, 4]
    assert ref_counts(kv.full.pool)[:5] == [2, 2, 0, 1, 1]
    assert free_ids(kv.full.pool) == [5, 6, 7, 8, 9, 2]

    kv.free(b)
    assert ref_counts(kv.full.pool)[:5] == [1, 1, 0, 0, 1]
    assert free_ids(kv.full.pool) == [5, 6, 7, 8, 9, 2, 3]
    kv.free(c)
    assert free_ids(kv.full.pool) == [5, 6, 7, 8, 9, 2, 3, 4, 1, 0]


def test_hit_stops_at_least_one_token_short(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(8))  # exactly two full blocks
    prefill(kv, a)
    assert cached_ids(kv.full.pool) == [0, 1]
    kv.free(a)
    assert free_ids(kv.full.pool) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]

    # the same 8 tokens: only 1 block of 4 may be a hit, the last token must be computed
    b = make_request("b", range(8))
    hits, n = kv.get_computed_blocks(b)
    assert (ids(hits), n) == ([0], 4)
    assert kv.allocate_slots(b, 4, hits)
    assert kv.block_ids("b") == [0, 2]
    # b's second block holds the same content as cached block 1: the first copy stays registered
    assert kv.full.pool.blocks[2].block_hash is None
    assert kv.full.pool.cached[b.block_hashes[1]] is kv.full.pool.blocks[1]
    assert free_ids(kv.full.pool) == [3, 4, 5, 6, 7, 8, 9, 1]

    # one more token and both blocks are usable
    c = make_request("c", range(9))
    hits, n = kv.get_computed_blocks(c)
    assert (ids(hits), n) == ([0, 1], 8)
    kv.free(b)


def test_gap_in_cached_chain_ends_the_hit(make_manager):
    """Block 2 of the chain stays cached while block 1 is evicted: the hit must stop at the gap."""
    kv = make_manager(6)
    a = make_request("a", range(8))
    prefill(kv, a)
    kv.free(a)  # blocks 0 (h0) and 1 (h1) cached-free; queue [2, 3, 4, 5, 1, 0]
    b = make_request("b", range(8))
    hits, n = kv.get_computed_blocks(b)
    assert (ids(hits), n) == ([0], 4)
    assert kv.allocate_slots(b, 4, hits)
    b.num_computed_tokens = 8
    assert kv.block_ids("b") == [0, 2]  # block 2 duplicates block 1's content, unregistered
    for t in (100, 101, 102, 103):
        decode_one(kv, b, t)
    assert kv.block_ids("b") == [0, 2, 3]
    assert cached_ids(kv.full.pool) == [0, 1, 3]  # block 3 is registered under the chain h0, h1, h2
    assert free_ids(kv.full.pool) == [4, 5, 1]
    other = make_request("other", range(200, 210))
    prefill(kv, other)
    assert kv.block_ids("other") == [4, 5, 1]  # evicts block 1, the middle of b's chain
    kv.free(other)
    assert cached_ids(kv.full.pool) == [0, 3, 4, 5]  # 4 and 5 hold other's two full blocks
    assert kv.full.pool.blocks[1].block_hash is None

    c = make_request("c", list(range(8)) + [100, 101, 102, 103, 7])
    hits, n = kv.get_computed_blocks(c)
    assert (ids(hits), n) == ([0], 4)  # not [0, 3]: block 3 would sit at positions 4..7
    kv.free(b)


def test_short_prompts_get_no_hit(make_manager):
    kv = make_manager(4)
    a = make_request("a", range(4))
    prefill(kv, a)
    kv.free(a)
    for prompt in ([0], [0, 1, 2], [0, 1, 2, 3]):
        hits, n = kv.get_computed_blocks(make_request("x", prompt))
        assert (hits, n) == ([], 0), prompt
    hits, n = kv.get_computed_blocks(make_request("y", [0, 1, 2, 3, 4]))
    assert (ids(hits), n) == ([0], 4)


def test_partial_tail_block_is_never_cached(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(10))
    prefill(kv, a)
    kv.free(a)
    assert len(kv.full.pool.cached) == 2
    # a longer prompt that extends a's partial block: only the two full blocks hit
    b = make_request("b", range(13))
    hits, n = kv.get_computed_blocks(b)
    assert (ids(hits), n) == ([0, 1], 8)
    assert kv.full.pool.blocks[2].block_hash is None


def test_chunked_prefill_registers_blocks_as_they_fill(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(10))
    assert kv.allocate_slots(a, 6)  # first chunk: tokens 0..5
    assert kv.block_ids("a") == [0, 1]
    assert cached_ids(kv.full.pool) == [0]
    assert kv.num_cached_blocks == {"a": 1}
    probe = make_request("probe", range(10))
    hits, n = kv.get_computed_blocks(probe)
    assert (ids(hits), n) == ([0], 4)
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 4)  # second chunk: tokens 6..9
    assert kv.block_ids("a") == [0, 1, 2]
    assert cached_ids(kv.full.pool) == [0, 1]
    assert kv.num_cached_blocks == {"a": 2}
    hits, n = kv.get_computed_blocks(probe)
    assert (ids(hits), n) == ([0, 1], 8)
    kv.free(a)


def test_decode_that_fills_a_block_registers_it(make_manager):
    kv = make_manager(10)
    r = make_request("r", range(6))
    prefill(kv, r)
    assert kv.block_ids("r") == [0, 1]
    assert cached_ids(kv.full.pool) == [0]
    decode_one(kv, r, 6)  # 7 tokens: block 1 still partial
    assert kv.block_ids("r") == [0, 1]
    assert cached_ids(kv.full.pool) == [0]
    decode_one(kv, r, 7)  # 8 tokens: block 1 full
    assert kv.block_ids("r") == [0, 1]
    assert cached_ids(kv.full.pool) == [0, 1]
    assert kv.full.pool.blocks[1].token_ids == (4, 5, 6, 7)
    assert kv.num_cached_blocks == {"r": 2}
    decode_one(kv, r, 8)  # 9 tokens: a new block
    assert kv.block_ids("r") == [0, 1, 2]
    assert free_ids(kv.full.pool) == [3, 4, 5, 6, 7, 8, 9]
    assert cached_ids(kv.full.pool) == [0, 1]

    # a new prompt equal to r's tokens so far shares the decoded block while r runs
    s = make_request("s", range(9))
    hits, n = kv.get_computed_blocks(s)
    assert (ids(hits), n) == ([0, 1], 8)
    assert kv.allocate_slots(s, 1, hits)
    assert kv.block_ids("s") == [0, 1, 3]
    assert ref_counts(kv.full.pool)[:4] == [2, 2, 1, 1]
    kv.free(r)
    kv.free(s)
    assert free_ids(kv.full.pool) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_salt_separates_caches(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(10), cache_salt="alice")
    prefill(kv, a)
    b = make_request("b", range(10), cache_salt="bob")
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([], 0)
    assert b.block_hashes[0] != a.block_hashes[0]
    assert kv.allocate_slots(b, 10, hits)
    assert kv.block_ids("b") == [3, 4, 5]
    assert cached_ids(kv.full.pool) == [0, 1, 3, 4]  # the same content is cached once per salt
    assert kv.get_computed_blocks(make_request("nosalt", range(10))) == ([], 0)
    hits, n = kv.get_computed_blocks(make_request("a2", range(10), cache_salt="alice"))
    assert (ids(hits), n) == ([0, 1], 8)
    hits, n = kv.get_computed_blocks(make_request("b2", range(10), cache_salt="bob"))
    assert (ids(hits), n) == ([3, 4], 8)
    kv.free(a)
    kv.free(b)


def test_prefix_counters_count_recorded_lookups_only(make_manager):
    kv = make_manager(10)
    a = make_request("a", range(10))
    prefill(kv, a)
    kv.free(a)
    b = make_request("b", range(10))
    _, n = kv.get_computed_blocks(b)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)  # a lookup alone counts nothing
    kv.record_prefix_lookup(b, n)
    assert (kv.prefix_queries, kv.prefix_hits) == (10, 8)
    kv.record_prefix_lookup(make_request("c", range(5)), 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (15, 8)


def test_scheduler_counts_each_admission_once(make_scheduler):
    """A request blocked in the waiting queue is looked up every step but counted when admitted."""
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64, max_num_seqs=1)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=4, temperature=0), max_total_tokens=16)
    b = Request("b", list(range(12)), SamplingParams(max_tokens=4, temperature=0), max_total_tokens=16)
    sched.add_request(a)
    sched.add_request(b)
    blocked_steps = 0
    while sched.has_unfinished:
        out = sched.schedule()
        blocked_steps += b.status.value == "waiting"
        for r in sched.update_after_step(out):
            r.append_token(99)
            if r.check_stop_token():
                sched.finish(r, r.status)
    assert blocked_steps > 1  # b waited while a ran, and was admitted (and counted) once
    assert sched.num_preemptions == 0
    assert sched.kv.prefix_queries == 24
    assert sched.kv.prefix_hits == 8  # b reused a's two full blocks of 4 (12 tokens, one short: 8)


def test_caching_disabled(make_manager):
    kv = make_manager(6, enable_caching=False)
    a = make_request("a", range(10))
    prefill(kv, a)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.full.pool.cached == {}
    assert all(b.block_hash is None for b in kv.full.pool.blocks)
    kv.free(a)
    assert free_ids(kv.full.pool) == [3, 4, 5, 2, 1, 0]
    b = make_request("b", range(10))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    prefill(kv, b)
    assert kv.block_ids("b") == [3, 4, 5]
    kv.free(b)


def test_reset_prefix_cache(make_manager):
    kv = make_manager(6)
    a = make_request("a", range(10))
    prefill(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.full.pool.cached == {}
    assert free_ids(kv.full.pool) == [3, 4, 5, 2, 1, 0]
    assert kv.get_computed_blocks(make_request("b", range(10))) == ([], 0)


# --- out of blocks --------------------------------------------------------------------------------------
def test_allocate_slots_false_leaves_state_unchanged(make_manager):
    kv = make_manager(3)
    a = make_request("a", range(12))
    prefill(kv, a)
    assert kv.block_ids("a") == [0, 1, 2]
    assert free_ids(kv.full.pool) == []

    b = make_request("b", range(50, 55))
    before = manager_snapshot(kv)
    assert kv.allocate_slots(b, 5) is False
    assert manager_snapshot(kv) == before
    assert "b" not in kv.full.tables and "b" not in kv.num_cached_blocks

    # a running request that needs a fourth block for its next token
    a.append_token(12)
    before = manager_snapshot(kv)
    assert kv.allocate_slots(a, 1) is False
    assert manager_snapshot(kv) == before
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(a)


def test_allocate_slots_counts_cached_free_hits_as_unavailable(make_manager):
    kv = make_manager(4)
    a = make_request("a", range(10))
    prefill(kv, a)
    kv.free(a)  # free queue [3, 2, 1, 0]; 0 and 1 cached-free
    holder = make_request("holder", [50, 51, 52])
    prefill(kv, holder)
    assert kv.block_ids("holder") == [3]
    assert free_ids(kv.full.pool) == [2, 1, 0]

    # 13 tokens: hits [0, 1] leave 1 free block, but 2 more are needed
    b = make_request("b", list(range(8)) + [60, 61, 62, 63, 64])
    hits, n = kv.get_computed_blocks(b)
    assert (ids(hits), n) == ([0, 1], 8)
    before = manager_snapshot(kv)
    assert kv.allocate_slots(b, 5, hits) is False
    assert manager_snapshot(kv) == before
    assert ref_counts(kv.full.pool) == [0, 0, 0, 1]

    # 12 tokens: one new block is needed and exactly one is available
    c = make_request("c", list(range(8)) + [60, 61, 62, 63])
    hits, n = kv.get_computed_blocks(c)
    assert (ids(hits), n) == ([0, 1], 8)
    assert kv.allocate_slots(c, 4, hits)
    assert kv.block_ids("c") == [0, 1, 2]
    assert free_ids(kv.full.pool) == []
    assert ref_counts(kv.full.pool) == [1, 1, 1, 1]
    assert cached_ids(kv.full.pool) == [0, 1, 2]
    kv.free(c)
    kv.free(holder)
    assert free_ids(kv.full.pool) == [2, 1, 0, 3]


# --- the teardown check itself --------------------------------------------------------------------------
def test_leak_report_detects_held_and_lost_blocks(make_manager):
    kv = make_manager(4)
    assert leak_report(kv) == []
    a = make_request("a", range(5))
    prefill(kv, a)
    report = leak_report(kv)
    assert any("still referenced" in p for p in report)
    assert any("free queue has 2 blocks" in p for p in report)
    assert any("block tables still present" in p for p in report)
    kv.free(a)
    assert leak_report(kv) == []
    # a block lost from the free queue without being referenced is also reported
    lost = kv.full.pool.free_queue.popitem(last=False)[1]
    assert any("free queue has 3 blocks" in p for p in leak_report(kv))
    kv.full.pool.free_queue[lost.block_id] = lost
    assert leak_report(kv) == []
