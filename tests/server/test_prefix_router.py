"""``prefix_router``: the replica choice by cached prefix, then queue length. No Ray, no model."""

from __future__ import annotations

import pytest

from kvserve.kv.hashing import PROCESS_KEY, extend_block_hashes
from kvserve.kv.manager import KVCacheManager
from kvserve.server.replicas.prefix_router import PrefixIndex, ReplicaReport, chain_hashes, leading_matches

BS = 4
KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))


def report(key: bytes, tokens: list[int]) -> ReplicaReport:
    return ReplicaReport(key, BS, frozenset(chain_hashes(tokens, BS, key)))


def test_chain_hashes_are_the_pools_wire_hashes():
    """The router's chain is what a pool hashing with the same key stores (low 64 bits)."""
    tokens = list(range(10))
    kv = KVCacheManager(8, BS, True, KEY_A)
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BS, None, kv.hash_key)
    assert chain_hashes(tokens, BS, KEY_A) == [h & (2**64 - 1) for h in hashes]
    assert len(chain_hashes(tokens, BS, KEY_A)) == 2  # the partial tail block has no hash
    assert chain_hashes(tokens, BS, KEY_A) != chain_hashes(tokens, BS, KEY_B)


def test_leading_matches_stop_at_the_first_miss():
    assert leading_matches([1, 2, 3, 4], {1, 2, 4}) == 2
    assert leading_matches([1, 2], set()) == 0


def test_longest_reported_prefix_wins_with_each_replicas_own_key():
    index = PrefixIndex(BS)
    prompt = list(range(20))
    index.report("a", report(KEY_A, prompt[:8]))  # 2 blocks
    index.report("b", report(KEY_B, prompt[:12]))  # 3 blocks
    assert index.matches(prompt, ["a", "b", "c"]) == {"a": 2, "b": 3, "c": 0}
    assert index.rank(prompt, {"a": 0, "b": 0, "c": 0}) == [["b"], ["a", "c"]]


def test_a_report_under_another_key_does_not_match():
    index = PrefixIndex(BS)
    prompt = list(range(20))
    index.report("a", ReplicaReport(KEY_B, BS, frozenset(chain_hashes(prompt, BS, KEY_A))))
    assert index.matches(prompt, ["a"]) == {"a": 0}


def test_no_match_is_one_rank_for_the_queue_to_decide():
    index = PrefixIndex(BS)
    assert index.rank(list(range(20)), {"a": 3, "b": 0}) == [["a", "b"]]


def test_sent_chains_count_before_the_next_report():
    now = [0.0]
    index = PrefixIndex(BS, sent_ttl_s=10, clock=lambda: now[0])
    prompt = list(range(16))
    index.record_sent("a", prompt)
    assert index.rank(prompt + [99, 98, 97, 96], {"a": 0, "b": 0}) == [["a"], ["b"]]
    now[0] = 11.0  # expired: a report has shown the blocks by now, or they were evicted
    assert index.matches(prompt, ["a"]) == {"a": 0}


def test_a_holder_too_far_behind_the_shortest_queue_is_passed_over():
    index = PrefixIndex(BS, imbalance_threshold=2)
    prompt = list(range(16))
    index.report("a", report(KEY_A, prompt))
    assert index.rank(prompt, {"a": 2, "b": 0}) == [["a"], ["b"]]
    assert index.rank(prompt, {"a": 3, "b": 0}) == [["a", "b"]]
    assert index.rank(prompt, {"a": None, "b": None}) == [["a"], ["b"]]  # unknown: counted as empty


def test_ties_between_holders_stay_in_one_rank():
    index = PrefixIndex(BS)
    prompt = list(range(8))
    index.report("a", report(KEY_A, prompt))
    index.report("b", report(KEY_B, prompt))
    assert index.rank(prompt, {"a": 1, "b": 0, "c": 0}) == [["a", "b"], ["c"]]


def test_a_dead_replica_is_forgotten():
    index = PrefixIndex(BS)
    prompt = list(range(8))
    index.report("a", report(KEY_A, prompt))
    index.record_sent("a", prompt)
    index.forget("a")
    assert index.matches(prompt, ["a"]) == {"a": 0}


@pytest.mark.parametrize("stats", [None, {}, {"queue": 3}])
def test_no_report_before_the_first_stats(stats):
    assert ReplicaReport.from_stats(stats) is None


def test_report_from_stats():
    r = ReplicaReport.from_stats({"hash_key": PROCESS_KEY, "block_size": 16, "cached": [1, 2]})
    assert r == ReplicaReport(PROCESS_KEY, 16, frozenset({1, 2}))


def test_a_short_shared_start_is_no_affinity():
    """A system prompt every chat shares must not pull all traffic to the replica that saw it first."""
    index = PrefixIndex(BS, min_match_fraction=0.25)
    system = list(range(8))  # 2 blocks
    index.report("a", report(KEY_A, system))
    assert index.rank(system + list(range(100, 132)), {"a": 0, "b": 0}) == [["a", "b"]]  # 2 of 10 blocks
    assert index.rank(system + list(range(100, 108)), {"a": 0, "b": 0}) == [["a"], ["b"]]  # 2 of 4
