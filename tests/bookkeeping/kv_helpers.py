"""Shared helpers for the KV-cache bookkeeping tests (plain Python, no tensors).

Imported by ``conftest.py`` and by the test modules of ``tests/bookkeeping``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager

BLOCK_SIZE = 4


def make_request(
    request_id: str,
    prompt: Iterable[int],
    max_tokens: int | None = 8,
    max_total_tokens: int = 1024,
    cache_salt: str | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0),
        max_total_tokens=max_total_tokens,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
    )


# --- views ----------------------------------------------------------------------------------------------
def free_ids(pool: BlockPool) -> list[int]:
    """The free queue, head (next to be allocated) first."""
    return list(pool.free_queue)


def ref_counts(pool: BlockPool) -> list[int]:
    return [b.ref_count for b in pool.blocks]


def cached_ids(pool: BlockPool) -> list[int]:
    """Ids of the blocks registered in the prefix cache, sorted."""
    return sorted(b.block_id for b in pool.cached.values())


def manager_snapshot(kv: KVCacheManager) -> dict:
    """Everything allocate_slots could touch, as plain values."""
    pool = kv.full.pool
    return {
        "free": free_ids(pool),
        "refs": ref_counts(pool),
        "hashes": [(b.block_hash, b.token_ids) for b in pool.blocks],
        "cached": {h: b.block_id for h, b in pool.cached.items()},
        "req_blocks": {rid: [b.block_id for b in bl] for rid, bl in kv.full.tables.items()},
        "num_cached_blocks": dict(kv.num_cached_blocks),
    }


# --- invariants -----------------------------------------------------------------------------------------
def leak_report(kv: KVCacheManager) -> list[str]:
    """Why ``kv`` is not back to "everything free"; empty when it is."""
    pool = kv.full.pool
    problems = []
    held = {b.block_id: b.ref_count for b in pool.blocks if b.ref_count != 0}
    if held:
        problems.append(f"blocks still referenced (block_id: ref_count): {held}")
    if len(pool.free_queue) != pool.num_blocks:
        problems.append(f"free queue has {len(pool.free_queue)} blocks, expected {pool.num_blocks}")
    if sorted(pool.free_queue) != list(range(pool.num_blocks)):
        problems.append(f"free queue ids are not exactly 0..{pool.num_blocks - 1}: {free_ids(pool)}")
    live_tables = {rid: [b.block_id for b in bl] for rid, bl in kv.full.tables.items()}
    if live_tables:
        problems.append(f"block tables still present: {live_tables}")
    if kv.num_cached_blocks:
        problems.append(f"num_cached_blocks still present: {kv.num_cached_blocks}")
    for window in kv.tied:
        held = {b.block_id: b.ref_count for b in window.pool.blocks[1:] if b.ref_count != 0}
        if held:
            problems.append(f"window blocks still referenced: {held}")
        if window.pool.blocks[0].ref_count != 1 or window.tables:
            problems.append(
                f"window: null block refs {window.pool.blocks[0].ref_count}, tables {window.tables}")
    return problems


def check_manager_invariants(kv: KVCacheManager) -> None:
    _check_block_refs(kv)
    _check_prefix_index(kv)
    if not kv.enable_caching:
        assert not kv.full.pool.cached
    assert set(kv.num_cached_blocks) == set(kv.full.tables)
    for rid, n in kv.num_cached_blocks.items():
        assert 0 <= n <= len(kv.full.tables[rid]), (
            f"{rid}: num_cached_blocks {n} > table {len(kv.full.tables[rid])}"
        )
    if kv.tied:
        check_window_invariants(kv)


def _check_block_refs(kv: KVCacheManager) -> None:
    """Each block table holds each block once and only the pool's own objects; a block's ref_count is the
    number of tables holding it; the free queue is exactly the blocks no table holds."""
    pool = kv.full.pool
    refs_from_tables: Counter[int] = Counter()
    for rid, blocks in kv.full.tables.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"request {rid} holds a block twice: {ids}"
        for b in blocks:
            assert pool.blocks[b.block_id] is b, f"request {rid} holds a foreign block object {b}"
        refs_from_tables.update(ids)
    for b in pool.blocks:
        assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
        assert b.ref_count == refs_from_tables[b.block_id], (
            f"block {b.block_id}: ref_count {b.ref_count} but referenced by "
            f"{refs_from_tables[b.block_id]} block tables"
        )
    free = {bid for bid, blk in pool.free_queue.items()}
    for bid, blk in pool.free_queue.items():
        assert blk is pool.blocks[bid], f"free queue key {bid} maps to block {blk.block_id}"
    assert free == {b.block_id for b in pool.blocks if b.ref_count == 0}, (
        f"free queue {sorted(free)} != blocks with ref_count 0 "
        f"{sorted(b.block_id for b in pool.blocks if b.ref_count == 0)}"
    )


def _check_prefix_index(kv: KVCacheManager) -> None:
    """The prefix-cache index and the blocks agree: each indexed block has the hash it is indexed under
    and a full block of tokens; each block with a hash is the one indexed under it, one without has no
    tokens."""
    pool = kv.full.pool
    for h, blk in pool.cached.items():
        assert blk.block_hash == h, f"cached[{h}] is block {blk.block_id} whose hash is {blk.block_hash}"
        assert blk.token_ids is not None and len(blk.token_ids) == kv.block_size
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool.cached.get(b.block_hash) is b, f"block {b.block_id} has a hash but is not indexed"
        else:
            assert b.token_ids is None


def check_window_invariants(kv: KVCacheManager) -> None:
    """The window group: tables as long as the block tables, each block held once per table that
    holds it, the null block never handed out, and a cached window block tied to the full group's
    block at its position while that block is cached."""
    window, = kv.tied
    pool = window.pool
    assert set(window.tables) == set(kv.full.tables), (sorted(window.tables), sorted(kv.full.tables))
    refs: Counter[int] = Counter()
    for rid, table in window.tables.items():
        assert len(table) == len(kv.full.tables[rid]), (
            f"{rid}: window table {len(table)} vs {len(kv.full.tables[rid])}"
        )
        ids = [b.block_id for b in table if b is not None]
        assert 0 not in ids and len(ids) == len(set(ids)), f"{rid}: window table {window.block_ids(rid)}"
        refs.update(ids)
    assert pool.blocks[0].ref_count == 1 and 0 not in pool.free_queue
    for b in pool.blocks[1:]:
        assert b.ref_count == refs[b.block_id], (
            f"window block {b.block_id}: {b.ref_count} refs, {refs[b.block_id]} tables"
        )
    assert set(pool.free_queue) == {b.block_id for b in pool.blocks[1:] if b.ref_count == 0}


def check_scheduler_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    check_manager_invariants(kv)
    bs = kv.block_size
    running_ids = [r.request_id for r in sched.running]
    waiting_ids = [r.request_id for r in sched.waiting]
    assert len(set(running_ids)) == len(running_ids), f"running has duplicates: {running_ids}"
    assert len(set(waiting_ids)) == len(waiting_ids), f"waiting has duplicates: {waiting_ids}"
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    assert set(running_ids) | set(waiting_ids) == set(sched.requests), "requests dict out of sync with queues"
    assert len(sched.running) <= sched.config.max_num_seqs
    # only running requests own blocks
    assert set(kv.full.tables) <= set(running_ids), (
        f"non-running requests own blocks: {set(kv.full.tables) - set(running_ids)}"
    )
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.status
        assert r.num_computed_tokens == 0, f"waiting {r.request_id} has {r.num_computed_tokens} computed"
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING, r.status
        assert 0 < r.num_computed_tokens <= r.num_tokens
        table = kv.full.tables.get(r.request_id, [])
        # the table covers exactly the computed tokens: no leaked spare blocks, none missing
        assert len(table) == kv.blocks_needed(r.num_computed_tokens), (
            f"{r.request_id}: {len(table)} blocks for {r.num_computed_tokens} computed tokens"
        )
        # every registered block in the table holds this request's tokens at that position
        for i, b in enumerate(table):
            if b.block_hash is not None:
                assert b.token_ids == tuple(r.all_token_ids[i * bs : (i + 1) * bs]), (
                    f"{r.request_id}: block {b.block_id} at index {i} caches {b.token_ids}"
                )


# --- a shadow of the KV tensors -------------------------------------------------------------------------
def prefix_ids(tokens: list[int], end: int) -> list[int]:
    """``out[p]`` identifies ``tokens[: p + 1]`` (a chained hash; collisions are negligible here)."""
    out, h = [], 0
    for t in tokens[:end]:
        h = hash((h, t))
        out.append(h)
    return out


@dataclass
class ShadowKV:
    """A stand-in for the paged KV tensors. The K/V written at position ``p`` depends on every token up
    to ``p`` (attention), so each slot records an id of that whole token prefix. After the step's writes
    (one forward writes all new K/V before attending), every position a scheduled request attends to
    must hold exactly its own prefix: a wrong prefix hit, an evicted or overwritten block still in use,
    or two requests writing one slot all show up here."""

    kv: KVCacheManager
    slots: dict[int, int] = field(default_factory=dict)
    window_slots: dict[int, int] = field(default_factory=dict)  # the window group's, when there is one

    def apply(self, out: SchedulerOutput) -> None:
        bs = self.kv.block_size
        expected = {}
        for s in out.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            expected[r.request_id] = ids = prefix_ids(r.all_token_ids, end)
            table = self.kv.block_ids(r.request_id)
            assert len(table) * bs >= end, f"{r.request_id}: table {table} too short for {end} tokens"
            window_table = self.kv.tied[0].block_ids(r.request_id) if self.kv.tied else None
            for p in range(start, end):
                self.slots[table[p // bs] * bs + p % bs] = ids[p]
                if window_table is not None:
                    assert window_table[p // bs] != 0, (
                        f"{r.request_id}: position {p} written to the null block"
                    )
                    self.window_slots[window_table[p // bs] * bs + p % bs] = ids[p]
        for s in out.scheduled:
            r = s.request
            table = self.kv.block_ids(r.request_id)
            for p, want in enumerate(expected[r.request_id]):
                if self.slots.get(table[p // bs] * bs + p % bs) != want:
                    raise AssertionError(
                        f"{r.request_id} would attend to wrong K/V at position {p} (block table {table}, "
                        f"tokens {r.all_token_ids}): the slot was not written with this prefix"
                    )
            window_table = self.kv.tied[0].block_ids(r.request_id) if self.kv.tied else None
            if window_table is not None:  # what the step's first query reads in a sliding layer
                first = max(0, r.num_computed_tokens - self.kv.tied[0].window + 1)
                for p in range(first, len(expected[r.request_id])):
                    if (
                        self.window_slots.get(window_table[p // bs] * bs + p % bs)
                        != expected[r.request_id][p]
                    ):
                        raise AssertionError(
                            f"{r.request_id} would read wrong window K/V at position {p} (window table "
                            f"{window_table}, tokens {r.all_token_ids})")


# --- driving the scheduler ------------------------------------------------------------------------------
def default_next_token(request: Request) -> int:
    return 1000 + request.num_tokens


@dataclass
class StepResult:
    out: SchedulerOutput
    ready: list[Request]
    finished: list[Request]

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        return [(s.request.request_id, s.num_new_tokens) for s in self.out.scheduled]

    @property
    def preempted(self) -> list[str]:
        return [r.request_id for r in self.out.preempted]


def simulate_step(
    sched: Scheduler,
    next_token: Callable[[Request], int] = default_next_token,
    shadow: ShadowKV | None = None,
) -> StepResult:
    """One engine step without a model: schedule, (pretend to) compute, sample, finish."""
    out = sched.schedule()
    if shadow is not None:
        shadow.apply(out)
    ready = sched.update_after_step(out)
    finished = []
    for request in ready:
        request.append_token(next_token(request))
        request.check_stop_token()
        if request.is_finished:
            sched.finish(request, request.status)
            finished.append(request)
    return StepResult(out, ready, finished)


def run_until_done(
    sched: Scheduler,
    max_steps: int = 500,
    next_token: Callable[[Request], int] = default_next_token,
    shadow: ShadowKV | None = None,
    check: bool = True,
) -> list[StepResult]:
    steps = []
    while sched.has_unfinished:
        assert len(steps) < max_steps, f"no completion after {max_steps} steps (livelock?)"
        steps.append(simulate_step(sched, next_token, shadow))
        if check:
            check_scheduler_invariants(sched)
    return steps
