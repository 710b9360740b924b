"""engine/heap.HeapWatch: the C heap is trimmed after a prefill-sized step that grew the process by
GROWTH_BEFORE_TRIM since the last trim, and never after decode-sized steps or smaller growth (the
resident sizes it would see in a long prefill are measured by bench/plan_vs_rss.py, not here)."""

from __future__ import annotations

import pytest

from kvserve.engine import heap


@pytest.fixture
def fake_process(monkeypatch):
    state = {"rss": 100 << 20, "trims": 0}

    def trim() -> None:
        state["trims"] += 1
        state["rss"] = 100 << 20  # the heap's free pages handed back

    monkeypatch.setattr(heap, "resident_bytes", lambda: state["rss"])
    monkeypatch.setattr(heap, "release_freed_memory", trim)
    return state


def test_trims_only_after_growth_in_big_steps(fake_process):
    watch = heap.HeapWatch()
    fake_process["rss"] += heap.GROWTH_BEFORE_TRIM + 1
    watch.after_step(heap.TRIM_AFTER_TOKENS - 1)  # a decode step: left alone
    assert fake_process["trims"] == 0
    watch.after_step(512)
    assert fake_process["trims"] == 1 and watch.mark == 100 << 20
    fake_process["rss"] += heap.GROWTH_BEFORE_TRIM  # not more than the allowance
    watch.after_step(512)
    assert fake_process["trims"] == 1


def test_no_statm_no_trims(monkeypatch):
    monkeypatch.setattr(heap, "resident_bytes", lambda: None)
    monkeypatch.setattr(heap, "release_freed_memory",
                        lambda: pytest.fail("trimmed without a resident size"))
    heap.HeapWatch().after_step(4096)


def test_resident_bytes_reads_this_process():
    rss = heap.resident_bytes()
    if rss is None:
        pytest.skip("no /proc/self/statm on this system")
    assert 10 << 20 < rss < 64 << 30
