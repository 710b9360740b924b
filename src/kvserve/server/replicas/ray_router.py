"""``KVPrefixRouter``: Ray Serve's request-router extension point, fed with kvserve's block hashes.

It routes the engine deployment's ``generate(prompt_token_ids, params, request_id)`` calls. The
ingress tokenized the prompt with the model's own tokenizer, so the router hashes the very tokens
the replica will: ``prefix_router.PrefixIndex`` ranks the replicas by the prefix they hold, and
Ray's ``_select_from_candidate_replicas`` takes the shortest queue within the first rank with room.

Unlike Ray's own routers this one is not FIFO across requests (no ``FIFOMixin``): a routing task
must place the request it was started for, or the replica chosen for one prompt's prefix would
serve another prompt.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.server.replicas.prefix_router import PrefixIndex, ReplicaReport

POLICIES = ("prefix", "random")


def prompt_tokens(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids: ``generate``'s first argument. None for other calls (``describe``)."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, list) else None


class KVPrefixRouter(RequestRouter):
    def initialize_state(
        self, block_size: int = 16, imbalance_threshold: int = 8, policy: str = "prefix"
    ) -> None:
        """``policy`` "random" ignores prefixes and queues alike: the baseline that shows what
        prefix affinity is worth (``bench/ray_replicas.py``)."""
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.index = PrefixIndex(block_size, imbalance_threshold)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        tokens = prompt_tokens(pending_request)
        if pending_request is not None:
            # every candidate is in the ranks returned: when none has room (or none answers the queue-length
            # probe in time) Ray must back off before asking again, or it probes in a tight loop
            pending_request.routing_context.should_backoff = True
        if self.policy == "random":
            return [[random.choice(candidate_replicas)]] if candidate_replicas else []
        if tokens is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for rid, r in by_id.items():
            self.index.report(rid, ReplicaReport.from_stats(r.routing_stats))
        queue_lens = {rid: self._queue_len(r) for rid, r in by_id.items()}
        ranks = [[by_id[rid] for rid in rank] for rank in self.index.rank(tokens, queue_lens)]
        for rank in ranks:  # Ray takes the first of equal queues: new prefixes spread, not pile on one
            random.shuffle(rank)
        return ranks

    def _queue_len(self, replica: RunningReplica) -> int | None:
        if not self._use_replica_queue_len_cache:
            return None
        return self._replica_queue_len_cache.get(replica.replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        tokens = prompt_tokens(pending_request)
        if tokens is not None and self.policy == "prefix":
            self.index.record_sent(replica_id.unique_id, tokens)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)
