"""Scheduler: token budget, chunked prefill, ordering, preemption, abort and admission errors.

Steps are simulated without a model (see ``kv_helpers.simulate_step``): the sampled token is
``1000 + position``, so outputs are deterministic."""

from __future__ import annotations

import pytest

from kvserve.engine.request import RequestStatus
from kvserve.engine.scheduler import QueueFullError
from kvserve.errors import PromptTooLongError
from tests.bookkeeping.kv_helpers import (
    ShadowKV,
    check_scheduler_invariants,
    free_ids,
    make_request,
    ref_counts,
    run_until_done,
    simulate_step,
)


def add(sched, request_id, prompt, max_tokens=4, **kw):
    request = make_request(request_id, prompt, max_tokens=max_tokens, max_total_tokens=sched.max_model_len,
                           **kw)
    sched.add_request(request)
    return request


def step(sched, shadow=None):
    result = simulate_step(sched, shadow=shadow)
    check_scheduler_invariants(sched)
    return result


def test_empty_schedule(make_scheduler):
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.scheduled == [] and out.preempted == [] and out.num_tokens == 0
    assert sched.update_after_step(out) == []
    assert not sched.has_unfinished


# --- budget and chunked prefill -------------------------------------------------------------------------
def test_budget_splits_long_prompt_into_chunks(make_scheduler):
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=8)
    r = add(sched, "long", range(20), max_tokens=3)
    steps, tables, computed, ready = [], [], [], []
    while sched.has_unfinished:
        res = step(sched)
        steps.append(res.scheduled)
        computed.append(r.num_computed_tokens)
        ready.append([q.request_id for q in res.ready])
        if sched.has_unfinished:
            tables.append(sched.kv.block_ids("long"))
    assert steps == [[("long", 8)], [("long", 8)], [("long", 4)], [("long", 1)], [("long", 1)]]
    assert computed == [8, 16, 20, 21, 22]
    assert ready == [[], [], ["long"], ["long"], ["long"]]  # a token only once the prompt is done
    assert tables == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]
    assert r.output_token_ids == [1020, 1021, 1022]
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert free_ids(sched.kv.full.pool) == [6, 7, 5, 4, 3, 2, 1, 0]


def test_budget_is_shared_by_waiting_prompts_in_order(make_scheduler):
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=10)
    for i in range(3):
        add(sched, f"r{i}", range(10 * i, 10 * i + 4), max_tokens=2)
    res = step(sched)
    assert res.scheduled == [("r0", 4), ("r1", 4), ("r2", 2)]
    assert res.out.num_tokens == 10
    assert [q.request_id for q in res.ready] == ["r0", "r1"]
    assert step(sched).scheduled == [("r0", 1), ("r1", 1), ("r2", 2)]
    run_until_done(sched)


def test_decodes_and_running_prefills_go_before_waiting_prefills(make_scheduler):
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    a = add(sched, "A", range(6), max_tokens=4)
    assert step(sched).scheduled == [("A", 6)]
    b = add(sched, "B", range(100, 110), max_tokens=2)
    d = add(sched, "D", range(200, 204), max_tokens=2)
    # A's decode first, then B's prefill takes the rest of the budget; D gets nothing
    assert step(sched).scheduled == [("A", 1), ("B", 7)]
    assert [r.request_id for r in sched.waiting] == ["D"]
    # B is running mid-prefill: it goes before the still-waiting D
    assert step(sched).scheduled == [("A", 1), ("B", 3), ("D", 4)]
    res = step(sched)
    assert res.scheduled == [("A", 1), ("B", 1), ("D", 1)]
    assert [r.request_id for r in res.finished] == ["A", "B", "D"]
    assert [len(r.output_token_ids) for r in (a, b, d)] == [4, 2, 2]
    assert not sched.has_unfinished


def test_max_num_seqs_is_respected(make_scheduler):
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        add(sched, f"r{i}", range(10 * i, 10 * i + 3), max_tokens=2)
    steps = []
    while sched.has_unfinished:
        steps.append(step(sched).scheduled)
        assert len(sched.running) <= 2
    assert steps == [
        [("r0", 3), ("r1", 3)],
        [("r0", 1), ("r1", 1)],
        [("r2", 3)],
        [("r2", 1)],
    ]


# --- prefix caching through the scheduler ---------------------------------------------------------------
@pytest.mark.parametrize("enable_caching", [True, False])
def test_prefix_hit_skips_cached_tokens(make_scheduler, enable_caching):
    sched = make_scheduler(num_blocks=16, enable_caching=enable_caching)
    add(sched, "a", range(10), max_tokens=1)
    run_until_done(sched)
    b = add(sched, "b", list(range(10)) + [50], max_tokens=1)
    out = sched.schedule()
    if enable_caching:
        assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 3)]
        assert b.num_computed_tokens == 8
        assert b.num_cached_tokens == 8 and b.metrics.num_cached_tokens == 8
        assert sched.kv.block_ids("b") == [0, 1, 3]
    else:
        assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 11)]
        assert b.num_computed_tokens == 0
        assert b.num_cached_tokens == 0
        assert sched.kv.block_ids("b") == [3, 4, 5]
    for r in sched.update_after_step(out):
        r.append_token(7)
        assert r.check_stop_token()
        sched.finish(r, r.status)


# --- preemption -----------------------------------------------------------------------------------------
def test_preempts_newest_running_request_and_everything_completes(make_scheduler):
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)  # 16 token slots
    shadow = ShadowKV(sched.kv)
    a = add(sched, "A", range(7), max_tokens=8)
    b = add(sched, "B", range(100, 107), max_tokens=8)
    assert step(sched, shadow).scheduled == [("A", 7), ("B", 7)]
    assert (sched.kv.block_ids("A"), sched.kv.block_ids("B")) == ([0, 1], [2, 3])
    assert step(sched, shadow).scheduled == [("A", 1), ("B", 1)]  # 8 tokens each: still 2 blocks
    assert free_ids(sched.kv.full.pool) == []

    res = step(sched, shadow)  # A needs a third block: B, the newest, is preempted
    assert res.preempted == ["B"]
    assert res.scheduled == [("A", 1)]
    assert [r.request_id for r in sched.running] == ["A"]
    assert [r.request_id for r in sched.waiting] == ["B"]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [1007, 1008]  # generated tokens are kept and recomputed later
    assert "B" not in sched.kv.full.tables
    assert sched.kv.block_ids("A") == [0, 1, 3]  # B's tail block went first
    assert ref_counts(sched.kv.full.pool) == [1, 1, 0, 1]
    assert free_ids(sched.kv.full.pool) == [2]
    assert sched.num_preemptions == 1 and b.metrics.num_preemptions == 1

    run_until_done(sched, shadow=shadow)
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == list(range(1007, 1015))
    assert b.output_token_ids == list(range(1007, 1015))
    assert a.metrics.num_preemptions == 0


def test_request_that_cannot_grow_preempts_itself_and_resumes_from_cache(make_scheduler):
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    shadow = ShadowKV(sched.kv)
    a = add(sched, "A", range(8), max_tokens=4)
    b = add(sched, "B", range(100, 108), max_tokens=4)
    assert step(sched, shadow).scheduled == [("A", 8), ("B", 8)]
    res = step(sched, shadow)
    # A takes the last free block; B needs one too and is itself the newest
    assert res.scheduled == [("A", 1)]
    assert res.preempted == ["B"]
    assert sched.kv.block_ids("A") == [0, 1, 4]
    assert free_ids(sched.kv.full.pool) == [3, 2]
    assert b.num_computed_tokens == 0 and b.num_tokens == 9

    # while A runs, B's prefix hits (blocks 2 and 3, cached-free) cannot be topped up with a new block
    assert step(sched, shadow).scheduled == [("A", 1)]
    res = step(sched, shadow)
    assert res.scheduled == [("A", 1)]
    assert [r.request_id for r in res.finished] == ["A"]
    assert free_ids(sched.kv.full.pool) == [3, 2, 4, 1, 0]

    res = step(sched, shadow)  # B comes back with both full blocks from the cache
    assert res.scheduled == [("B", 1)]
    assert sched.kv.block_ids("B") == [2, 3, 4]
    run_until_done(sched, shadow=shadow)
    assert a.output_token_ids == [1008, 1009, 1010, 1011]
    assert b.output_token_ids == [1008, 1009, 1010, 1011]
    assert b.num_cached_tokens == 0  # set on first scheduling only


def test_several_victims_go_to_the_front_of_waiting_oldest_first(make_scheduler):
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    shadow = ShadowKV(sched.kv)
    add(sched, "A", range(8), max_tokens=8)
    add(sched, "B", range(50, 54), max_tokens=4)
    add(sched, "C", range(60, 64), max_tokens=4)
    assert step(sched, shadow).scheduled == [("A", 8), ("B", 4), ("C", 4)]
    add(sched, "D", range(70, 73), max_tokens=1)
    res = step(sched, shadow)
    # A needs a block: C (newest) goes; then B needs one and is the newest left: B goes too
    assert res.preempted == ["C", "B"]
    assert res.scheduled == [("A", 1)]  # no admissions in a step that preempted, though budget remains
    assert [r.request_id for r in sched.waiting] == ["B", "C", "D"]
    assert all(sched.requests[i].num_computed_tokens == 0 for i in "BCD")
    assert sched.num_preemptions == 2
    steps = run_until_done(sched, shadow=shadow)
    assert sum(len(s.preempted) for s in steps) == 0  # A alone then fits; the rest run after it
    assert sched.num_preemptions == 2


def test_no_admission_in_a_step_that_preempted(make_scheduler):
    """V's blocks duplicate A's (same prompt, same outputs), so after V is preempted it could come back
    at once from A's cached blocks plus the one block left over; it must wait for the next step."""
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    shadow = ShadowKV(sched.kv)
    a = add(sched, "A", range(8), max_tokens=8)
    v = add(sched, "V", range(8), max_tokens=8)
    assert step(sched, shadow).scheduled == [("A", 8), ("V", 4)]  # one token short: 1 hit block
    assert (sched.kv.block_ids("A"), sched.kv.block_ids("V")) == ([0, 1], [0, 2])
    for _ in range(4):
        assert step(sched, shadow).scheduled == [("A", 1), ("V", 1)]
    assert (sched.kv.block_ids("A"), sched.kv.block_ids("V")) == ([0, 1, 3], [0, 2, 4])
    assert free_ids(sched.kv.full.pool) == []
    queries = sched.kv.prefix_queries

    res = step(sched, shadow)
    assert res.preempted == ["V"]
    assert res.scheduled == [("A", 1)]
    assert [r.request_id for r in sched.waiting] == ["V"]
    assert sched.kv.block_ids("A") == [0, 1, 3, 4]
    assert free_ids(sched.kv.full.pool) == [2]
    assert sched.kv.prefix_queries == queries  # not even looked up

    res = step(sched, shadow)  # back, sharing A's three full blocks
    assert res.scheduled == [("A", 1), ("V", 1)]
    assert sched.kv.block_ids("V") == [0, 1, 3, 2]
    assert ref_counts(sched.kv.full.pool) == [2, 2, 1, 2, 1]
    run_until_done(sched, shadow=shadow)
    assert a.output_token_ids == v.output_token_ids == list(range(1008, 1016))


# --- abort ----------------------------------------------------------------------------------------------
def test_abort_waiting_request(make_scheduler):
    sched = make_scheduler()
    r = add(sched, "r", range(5))
    assert sched.abort("r") is r
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert not sched.waiting and not sched.requests
    assert sched.abort("r") is None
    assert sched.abort("never-added") is None
    assert sched.schedule().is_empty


def test_abort_mid_prefill_frees_blocks(make_scheduler):
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    r = add(sched, "r", range(10))
    assert step(sched).scheduled == [("r", 4)]
    assert step(sched).scheduled == [("r", 4)]
    assert sched.kv.block_ids("r") == [0, 1]
    assert sched.abort("r") is r
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert not sched.running and not sched.requests
    assert free_ids(sched.kv.full.pool) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert ref_counts(sched.kv.full.pool) == [0] * 8
    # the computed full blocks stay reusable
    hits, n = sched.kv.get_computed_blocks(make_request("probe", range(10)))
    assert ([h.block_id for h in hits], n) == ([0, 1], 8)


def test_abort_running_decode_keeps_shared_blocks_for_the_other_owner(make_scheduler):
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    shadow = ShadowKV(sched.kv)
    a = add(sched, "a", range(9), max_tokens=6)
    step(sched, shadow)
    b = add(sched, "b", list(range(8)) + [42], max_tokens=3)
    assert step(sched, shadow).scheduled == [("a", 1), ("b", 1)]
    assert sched.kv.block_ids("a") == [0, 1, 2]
    assert sched.kv.block_ids("b") == [0, 1, 3]
    assert ref_counts(sched.kv.full.pool)[:4] == [2, 2, 1, 1]
    sched.abort("a")
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert ref_counts(sched.kv.full.pool)[:4] == [1, 1, 0, 1]
    assert free_ids(sched.kv.full.pool) == [4, 5, 6, 7, 2]
    check_scheduler_invariants(sched)
    run_until_done(sched, shadow=shadow)
    assert b.status is RequestStatus.FINISHED_LENGTH and len(b.output_token_ids) == 3


def test_abort_preempted_request(make_scheduler):
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    add(sched, "A", range(7), max_tokens=8)
    b = add(sched, "B", range(100, 107), max_tokens=8)
    step(sched)
    step(sched)
    assert step(sched).preempted == ["B"]
    assert sched.abort("B") is b
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert not sched.waiting
    check_scheduler_invariants(sched)
    run_until_done(sched)


def test_finished_request_is_not_scheduled_again(make_scheduler):
    sched = make_scheduler()
    r = add(sched, "r", range(3), max_tokens=1)
    res = step(sched)
    assert res.finished == [r]
    assert sched.schedule().is_empty
    assert sched.abort("r") is None


# --- admission errors -----------------------------------------------------------------------------------
def test_prompt_too_long(make_scheduler):
    sched = make_scheduler(num_blocks=4)  # max_model_len 16
    with pytest.raises(PromptTooLongError) as info:
        sched.add_request(make_request("x", range(16), max_total_tokens=16))
    assert (info.value.num_prompt_tokens, info.value.limit) == (16, 16)
    with pytest.raises(PromptTooLongError):
        sched.add_request(make_request("y", range(40), max_total_tokens=16))
    assert not sched.waiting and not sched.requests
    r = add(sched, "x", range(15), max_tokens=8)  # one slot left for a new token: accepted
    assert sched.waiting[0] is r
    run_until_done(sched)
    assert r.output_token_ids == [1015]


def test_prompt_too_long_uses_max_model_len(make_scheduler):
    sched = make_scheduler(num_blocks=16, max_model_len=10)
    with pytest.raises(PromptTooLongError):
        sched.add_request(make_request("x", range(10)))
    add(sched, "ok", range(9))
    sched.abort("ok")


def test_empty_prompt_rejected(make_scheduler):
    sched = make_scheduler()
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("e", []))
    assert not sched.requests


def test_queue_full(make_scheduler):
    """max_waiting bounds the requests that cannot start: one free running slot absorbs one more."""
    sched = make_scheduler(max_waiting=2, max_num_seqs=1)
    add(sched, "r0", range(3))  # will take the free slot
    add(sched, "r1", range(10, 13))
    add(sched, "r2", range(20, 23))
    with pytest.raises(QueueFullError):
        add(sched, "r3", range(30, 33))
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2"]
    assert "r3" not in sched.requests
    step(sched)  # r0 runs; r1 and r2 wait: still full
    with pytest.raises(QueueFullError):
        add(sched, "r3", range(30, 33))
    sched.abort("r1")  # room again, and the rejected id is free
    add(sched, "r3", range(30, 33))
    for rid in ("r0", "r2", "r3"):
        assert sched.abort(rid) is not None


def test_duplicate_request_id(make_scheduler):
    sched = make_scheduler()
    add(sched, "x", range(3), max_tokens=2)
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "x", range(10, 13))
    assert len(sched.waiting) == 1
    step(sched)
    assert [r.request_id for r in sched.running] == ["x"]
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "x", range(10, 13))
    run_until_done(sched)
    add(sched, "x", range(10, 13))  # reusable once finished
    sched.abort("x")
