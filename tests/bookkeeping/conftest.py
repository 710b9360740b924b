"""Fixtures for the KV bookkeeping tests: factories whose teardown fails the test on a block leak."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from tests.bookkeeping.kv_helpers import BLOCK_SIZE, leak_report


@pytest.fixture
def make_manager():
    """``make_manager(num_blocks, block_size=4, enable_caching=True)``. At teardown, every manager made
    here must have all blocks unreferenced, a full free queue and no block tables left."""
    created: list[KVCacheManager] = []

    def factory(num_blocks: int, block_size: int = BLOCK_SIZE, enable_caching: bool = True) -> KVCacheManager:
        kv = KVCacheManager(num_blocks, block_size, enable_caching)
        created.append(kv)
        return kv

    yield factory
    problems = [f"manager #{i}: {p}" for i, kv in enumerate(created) for p in leak_report(kv)]
    if problems:
        pytest.fail("KV blocks leaked at teardown:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture
def make_scheduler(make_manager):
    """``make_scheduler(num_blocks=16, max_num_batched_tokens=64, max_num_seqs=16, max_waiting=64,
    max_model_len=None (num_blocks * block_size, as the engine sizes it), enable_caching=True)``.
    At teardown every scheduler must have no request left, and its manager (checked by
    ``make_manager``) no block held."""
    created: list[Scheduler] = []

    def factory(
        num_blocks: int = 16,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        max_waiting: int = 64,
        max_model_len: int | None = None,
        enable_caching: bool = True,
        block_size: int = BLOCK_SIZE,
    ) -> Scheduler:
        kv = make_manager(num_blocks, block_size, enable_caching)
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting
        )
        sched = Scheduler(config, kv, max_model_len if max_model_len is not None else num_blocks * block_size)
        created.append(sched)
        return sched

    yield factory
    problems = []
    for i, sched in enumerate(created):
        if sched.running or sched.waiting or sched.requests:
            problems.append(
                f"scheduler #{i} has unfinished requests: running={[r.request_id for r in sched.running]} "
                f"waiting={[r.request_id for r in sched.waiting]} requests={sorted(sched.requests)}"
            )
    if problems:
        pytest.fail("requests left at teardown:\n  " + "\n  ".join(problems), pytrace=False)
