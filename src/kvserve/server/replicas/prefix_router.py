"""Which replica should serve a prompt: the one holding the longest prefix of its block-hash chain,
unless that replica's queue is too far behind the shortest. Plain Python, no Ray (``ray_router`` is
the glue that feeds it), so the policy tests in milliseconds.

What the router knows of a replica, per replica:

    reported   the wire hashes (low 64 bits) of the blocks its pool caches, with the key and block
               size its pool hashes with; sent by the replica every routing-stats period
    sent       the chains of the prompts routed to it since, hashed with the router's own key: their
               blocks are being computed there, and the next report will show them

A prompt's chain is hashed exactly as the pool hashes it (``kv.hashing.extend_block_hashes``, no
salt), once per key, so a match on ``reported`` means the pool had those very blocks at its last
report. A match is only a hint: the replica's pool checks the full hash, tokens and parent itself.

    tokens   [t0 .. t15][t16 .. t31][t32 .. t47][t48 ..]
    chain     h0         h1         h2                    replica A holds h0 h1     -> match 2
                                                          replica B holds h0 h1 h2  -> match 3: B
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.kv.events import wire_hash
from kvserve.kv.hashing import PROCESS_KEY, extend_block_hashes


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    hash_key: bytes  # the key the replica's pool hashes with (its process key, or the disk tier's)
    block_size: int
    cached: frozenset[int]  # wire hashes of the blocks in its prefix cache

    @classmethod
    def from_stats(cls, stats: dict | None) -> ReplicaReport | None:
        """From a replica's routing stats (``ray_serve.EngineReplica.record_routing_stats``); None
        before its first report."""
        if not stats or "hash_key" not in stats:
            return None
        return cls(stats["hash_key"], stats["block_size"], frozenset(stats["cached"]))


def chain_hashes(token_ids: list[int], block_size: int, key: bytes) -> list[int]:
    """Wire hashes of the prompt's full blocks, as the pool of a replica hashing with ``key`` names them."""
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, block_size, None, key)
    return [wire_hash(h) for h in hashes]


def leading_matches(chain: list[int], held: set[int] | frozenset[int]) -> int:
    """Blocks at the start of ``chain`` that are all in ``held``: a prefix hit stops at the first miss."""
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


@dataclass(slots=True)
class PrefixIndex:
    """The router's picture of every replica's prefix cache. ``sent`` entries expire after
    ``sent_ttl_s``: by then a report has shown the blocks, or they were evicted."""

    block_size: int
    imbalance_threshold: int = 8  # queue length beyond the shortest at which a prefix holder is passed over
    # a match shorter than this share of the prompt's blocks is no reason to pick a replica: the system
    # prompt every chat starts with is cached everywhere it went, and would pull all traffic to one
    min_match_fraction: float = 0.1
    sent_ttl_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    reports: dict[str, ReplicaReport] = field(default_factory=dict)
    sent: dict[str, dict[int, float]] = field(default_factory=dict)  # replica -> router-key hash -> time

    def report(self, replica: str, report: ReplicaReport | None) -> None:
        if report is not None:
            self.reports[replica] = report

    def forget(self, replica: str) -> None:
        """A replica that died: its cache went with it."""
        self.reports.pop(replica, None)
        self.sent.pop(replica, None)

    def record_sent(self, replica: str, token_ids: list[int]) -> None:
        now = self.clock()
        held = self.sent.setdefault(replica, {})
        for h in chain_hashes(token_ids, self.block_size, PROCESS_KEY):
            held[h] = now
        for h in [h for h, t in held.items() if now - t > self.sent_ttl_s]:
            del held[h]

    def matches(self, token_ids: list[int], replicas: list[str]) -> dict[str, int]:
        """Blocks of the prompt's prefix each replica is known to hold (reported or sent)."""
        chains: dict[tuple[bytes, int], list[int]] = {}

        def chain(key: bytes, block_size: int) -> list[int]:
            if (key, block_size) not in chains:  # replicas sharing a key (a disk tier's) hash once
                chains[key, block_size] = chain_hashes(token_ids, block_size, key)
            return chains[key, block_size]

        now = self.clock()
        result: dict[str, int] = {}
        for r in replicas:
            n = 0
            if (report := self.reports.get(r)) is not None:
                n = leading_matches(chain(report.hash_key, report.block_size), report.cached)
            fresh = {h for h, t in self.sent.get(r, {}).items() if now - t <= self.sent_ttl_s}
            if fresh:
                n = max(n, leading_matches(chain(PROCESS_KEY, self.block_size), fresh))
            result[r] = n
        return result

    def rank(self, token_ids: list[int], queue_lens: dict[str, int | None]) -> list[list[str]]:
        """Replicas in ranks, most preferred first; the caller takes the shortest queue within the
        first rank that has room. The first rank is the replicas holding the longest prefix, unless
        their queues exceed the shortest by more than ``imbalance_threshold``; without a match of at
        least ``min_match_fraction`` of the blocks, one rank of all. An unknown queue length counts as
        empty."""
        replicas = list(queue_lens)
        queue = {r: q or 0 for r, q in queue_lens.items()}
        matched = self.matches(token_ids, replicas)
        best = max(matched.values(), default=0)
        if best == 0 or best < self.min_match_fraction * (len(token_ids) // self.block_size):
            return [replicas]
        shortest = min(queue.values())
        holders = [
            r for r in replicas if matched[r] == best and queue[r] - shortest <= self.imbalance_threshold
        ]
        if not holders:
            return [replicas]
        rest = [r for r in replicas if r not in holders]
        return [holders, rest] if rest else [holders]
