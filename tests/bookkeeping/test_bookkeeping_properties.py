"""Property test: random interleavings of add / step / abort keep the KV bookkeeping consistent.

Small pools force preemption; a few shared prefixes and a 4-token alphabet make prefix hits (and
identical blocks computed twice) common. After every operation the manager and scheduler invariants
of ``kv_helpers`` are checked, and every step is run against a shadow of the KV tensors, so a prefix
hit or a reused block that would make a request attend to another request's tokens is caught.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.engine.request import RequestStatus
from kvserve.engine.scheduler import QueueFullError, Scheduler
from kvserve.errors import PromptTooLongError
from kvserve.kv.groups import WindowGroup, window_pool_blocks
from kvserve.kv.manager import KVCacheManager
from tests.bookkeeping.kv_helpers import (
    BLOCK_SIZE,
    ShadowKV,
    check_scheduler_invariants,
    leak_report,
    make_request,
)

PREFIXES = [
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3],
    [1, 2, 3, 1, 0, 0, 0, 0, 2, 2, 2, 2],
    [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3],
]
EOS = 3

configs = st.fixed_dictionaries(
    {
        "num_blocks": st.sampled_from([3, 4, 4, 5, 6]),
        # max_model_len = num_blocks * 4 - cut: the engine never lets it exceed the pool
        "model_len_cut": st.sampled_from([0, 1, 4, 5]),
        "budget": st.sampled_from([1, 3, 4, 7, 16, 24, 32]),
        "max_num_seqs": st.sampled_from([1, 2, 3, 4, 4, 4]),
        "max_waiting": st.sampled_from([1, 3, 64, 64]),
    }
)
request_specs = st.tuples(
    st.sampled_from(range(len(PREFIXES) + 1)),  # which shared prefix; len(PREFIXES) means none
    st.sampled_from([0, 3, 4, 5, 8, 9]),  # how much of it
    st.lists(st.integers(0, 3), min_size=1, max_size=4),  # own suffix (so never empty)
    st.sampled_from([1, 4, 8, 12, 12]),  # max_tokens
    st.sampled_from([None, None, None, "salt"]),
    st.sampled_from([False, False, False, True]),  # stops on EOS
)
add_ops = st.tuples(st.just("add"), st.lists(request_specs, min_size=1, max_size=4))  # a burst of arrivals
step_ops = st.tuples(st.just("step"), st.integers(1, 6))
abort_ops = st.tuples(st.just("abort"), st.integers(0, 63))
ops_lists = st.lists(st.one_of(*[add_ops, step_ops] * 4, abort_ops), min_size=8, max_size=40)


def next_token(request) -> int:
    return (request.num_tokens * 3 + int(request.request_id[1:])) % 4


def checked_step(sched: Scheduler, shadow: ShadowKV) -> None:
    """One simulated step, checking the step's own contract besides the global invariants."""
    kv = sched.kv
    running_before = [r.request_id for r in sched.running]
    waiting_before = [r.request_id for r in sched.waiting]
    out = sched.schedule()
    scheduled = [s.request.request_id for s in out.scheduled]
    preempted = [r.request_id for r in out.preempted]

    assert len(set(scheduled)) == len(scheduled), f"scheduled twice in one step: {scheduled}"
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert all(s.num_new_tokens >= 1 for s in out.scheduled)
    # victims are the newest running requests, newest first, and go to the front of waiting in age order
    assert preempted == running_before[::-1][: len(preempted)], (running_before, preempted)
    assert not set(preempted) & set(scheduled)
    survivors = [rid for rid in running_before if rid not in preempted]
    n_run = sum(1 for rid in scheduled if rid in running_before)
    # running requests first, in order; then waiting ones from the head, only if every runner got a turn
    assert scheduled[:n_run] == survivors[:n_run]
    admitted = scheduled[n_run:]
    assert admitted == waiting_before[: len(admitted)]
    if admitted:
        assert n_run == len(survivors) and not preempted
    if preempted:
        assert [r.request_id for r in sched.waiting] == preempted[::-1] + waiting_before
    # each request gets what it still needs, cut to the remaining budget
    budget = sched.config.max_num_batched_tokens
    for s in out.scheduled:
        r = s.request
        start = r.num_computed_tokens
        if r.request_id in admitted:
            if not kv.enable_caching:
                assert start == 0
            assert start % BLOCK_SIZE == 0 and start < r.num_tokens  # whole hit blocks, one token short
        assert s.num_new_tokens == min(r.num_tokens - start, budget)
        budget -= s.num_new_tokens

    shadow.apply(out)
    ready = sched.update_after_step(out)
    assert [r.request_id for r in ready] == [
        s.request.request_id for s in out.scheduled if s.request.num_computed_tokens == s.request.num_tokens
    ]
    for r in ready:
        r.append_token(next_token(r))
        r.check_stop_token()
        if r.is_finished:
            sched.finish(r, r.status)
            assert r.request_id not in kv.full.tables


def scheduler_for(config: dict, enable_caching: bool, window: int | None) -> tuple[Scheduler, int]:
    """The scheduler (and its max_model_len) for a drawn ``config``; with ``window``, a window group beside
    the pool, sized as the engine sizes it."""
    num_blocks = config["num_blocks"]
    max_model_len = max(2, num_blocks * BLOCK_SIZE - config["model_len_cut"])
    window_group = None
    if window is not None:
        size = window_pool_blocks(window, BLOCK_SIZE, config["max_num_seqs"], config["budget"])
        window_group = WindowGroup(1, size, BLOCK_SIZE, window, enable_caching)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching,
                        more_groups=() if window_group is None else (window_group,))
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["budget"],
            max_waiting=config["max_waiting"],
        ),
        kv,
        max_model_len,
    )
    return sched, max_model_len


def add_burst(sched: Scheduler, config: dict, max_model_len: int, n: int, specs: list) -> list:
    """Op ``n``'s burst of arrivals, each refused exactly when its prompt is too long or the waiting queue
    is full; the requests taken, in order."""
    added = []
    for k, (which, cut, suffix, max_tokens, salt, stops) in enumerate(specs):
        prompt = (PREFIXES[which][:cut] if which < len(PREFIXES) else []) + suffix
        request = make_request(
            f"r{n * 4 + k}", prompt, max_tokens, max_model_len, salt, (EOS,) if stops else ()
        )
        # requests that fit in free running slots do not count as waiting
        free_slots = max(0, config["max_num_seqs"] - len(sched.running))
        num_waiting = max(0, len(sched.waiting) - free_slots)
        try:
            sched.add_request(request)
        except PromptTooLongError:
            assert len(prompt) >= max_model_len
        except QueueFullError:
            assert len(prompt) < max_model_len and num_waiting >= config["max_waiting"]
        else:
            assert len(prompt) < max_model_len and num_waiting < config["max_waiting"]
            added.append(request)
    return added


def abort_one(sched: Scheduler, index: int) -> None:
    """Abort the live request at ``index`` (modulo their number), if any: it ends aborted, and nothing
    of it is left in the KV manager or the scheduler."""
    live = sorted(sched.requests)
    if live:
        victim = live[index % len(live)]
        request = sched.abort(victim)
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert victim not in sched.kv.full.tables and victim not in sched.requests


def drain_all(sched: Scheduler, shadow: ShadowKV, added: list) -> None:
    """Step until nothing is unfinished: everything admitted must complete (no livelock, no request
    stuck), a request ended by its length at exactly its max_total_tokens."""
    kv = sched.kv
    for _ in range(3000):
        if not sched.has_unfinished:
            break
        checked_step(sched, shadow)
        check_scheduler_invariants(sched)
    assert not sched.has_unfinished, (
        f"stuck: running={[(r.request_id, r.num_computed_tokens, r.num_tokens) for r in sched.running]} "
        f"waiting={[(r.request_id, r.num_tokens) for r in sched.waiting]} free={kv.full.pool.num_free_blocks}"
    )
    for r in added:
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_tokens == r.max_total_tokens


@pytest.mark.parametrize("window", [None, 1, 5], ids=["every-token", "window-1", "window-5"])
@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, ops=ops_lists, drain=st.sampled_from([True, True, False]))
def test_random_interleavings_keep_bookkeeping_consistent(enable_caching, window, config, ops, drain):
    """With ``window``, a window group beside the pool, sized as the engine sizes it: the shadow then
    checks what the sliding layers read too."""
    num_blocks = config["num_blocks"]
    sched, max_model_len = scheduler_for(config, enable_caching, window)
    kv = sched.kv
    shadow = ShadowKV(kv)
    added = []
    for n, op in enumerate(ops):
        if op[0] == "add":
            added += add_burst(sched, config, max_model_len, n, op[1])
        elif op[0] == "step":
            for _ in range(op[1]):
                checked_step(sched, shadow)
                check_scheduler_invariants(sched)
        else:
            abort_one(sched, op[1])
        check_scheduler_invariants(sched)
        assert kv.prefix_hits <= kv.prefix_queries and kv.prefix_hits % BLOCK_SIZE == 0

    if drain:  # everything admitted must complete: no livelock, no request stuck
        drain_all(sched, shadow, added)

    # coverage, shown by ``pytest --hypothesis-show-statistics``
    event("preempted" if sched.num_preemptions else "no preemption")
    event("prefix hits" if kv.prefix_hits else "no prefix hit")

    for rid in sorted(sched.requests):
        sched.abort(rid)
        check_scheduler_invariants(sched)
    assert not sched.has_unfinished and not sched.requests
    assert leak_report(kv) == []
    assert all(b.ref_count == 0 for b in kv.full.pool.blocks)
    assert len(kv.full.pool.free_queue) == num_blocks
