"""Continuous batching under a per-step token budget. Plain Python: no tensors.

There are no separate prefill and decode phases. Every request has known tokens (prompt plus
generated) and computed tokens (K/V in the cache); each step hands out a budget of tokens so that
computed catches up with known:

    step budget 512:  running decodes first, 1 token each     -> [r1:1] [r2:1] [r3:1]
                      then waiting prompts, chunked to fit    -> [r4: 509 of 2000 prompt tokens]

When blocks run out, the newest running request is preempted (its blocks freed, its progress reset;
it is recomputed later, largely from the prefix cache) rather than failing anyone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.speculative import Proposer
from kvserve.errors import KVServeError, PromptTooLongError
from kvserve.kv.manager import KVCacheManager


class QueueFullError(KVServeError):
    """Too many requests are waiting."""


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    # tokens computed this step, starting at request.num_computed_tokens (drafts included)
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens after the request's own


def shifted_context(tokens: list[int], num_keep: int, max_len: int) -> list[int]:
    """Context shift's rule (llama.cpp's and Ollama's): the first ``num_keep`` tokens (at most half the
    context) and the newer half of the rest."""
    keep = min(num_keep, max_len // 2)
    discard = (len(tokens) - keep) // 2
    return tokens[:keep] + tokens[keep + discard :]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
        proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_context_shifts = 0
        # requests of a step that failed: each runs alone until a step of its own succeeds
        self.suspects: set[str] = set()
        # after a failed step of n requests, steps take at most n // 2 until the engine is idle again
        # (a failure that comes with the batch's size, such as memory, does not come back at once)
        self.batch_cap: int | None = None

    # --- admission ------------------------------------------------------------------------------------
    def check_prompt(self, request: Request) -> None:
        """Raise unless the request's prompt can ever be served."""
        limit = self.max_model_len
        if request.num_prompt_tokens > self.prompt_room(request.params.pooling):
            raise PromptTooLongError(
                f"the prompt is {request.num_prompt_tokens} tokens but the context limit is {limit} "
                f"(room is needed for at least one new token)",
                request.num_prompt_tokens,
                limit,
            )
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")

    def check_capacity(self, num_pending: int = 0, count: int = 1) -> None:
        """Raise QueueFullError if ``count`` more requests (after ``num_pending`` others not yet added)
        would leave more than ``max_waiting`` requests unable to start: requests that fit in free
        running slots do not count as waiting."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        would_wait = max(0, len(self.waiting) + num_pending + count - free_slots)
        if would_wait > self.config.max_waiting:
            already = max(0, would_wait - count)
            raise QueueFullError(
                f"{already} requests are already waiting and this one needs {count} more "
                f"(limit {self.config.max_waiting} waiting); try again later"
                if count > 1
                else f"{already} requests are already waiting (limit {self.config.max_waiting}); try again "
                     f"later"
            )

    def add_request(self, request: Request) -> None:
        self.check_prompt(request)
        self.check_capacity()
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not self.has_unfinished:
            self.batch_cap = None  # idle since the failure: full batches again
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.suspects.discard(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.suspects:
            return self._schedule_suspect()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.batch_cap or self.config.max_num_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < cap:
            request = self.running[i]
            if request.num_tokens > self.max_model_len:  # its newest token has no position: shift
                self._shift(request)
                continue  # it waits at the head of the queue, to be recomputed
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget)
            if drafts and self.kv.allocate_slots(request, num_new + len(drafts)):
                out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                i += 1
            elif self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
            # else: request itself was preempted and removed from running; i now points at the next
        if out.preempted:  # no room for new work this step
            return out
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(out.scheduled) < cap):
            request = self.waiting[0]
            hits, num_hit_tokens = self._prefix_hits(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            self.kv.record_prefix_lookup(request, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.metrics.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Speculative tokens for a decoding request: room for them in the step's budget and in the
        request's length limit (a step emits up to one token more than it verifies)."""
        if (self.proposer is None or num_new != 1 or request.num_computed_tokens < request.num_prompt_tokens
                or request.params.stop):  # stop strings end a request mid-token-list: decode one at a time
            return []
        left = request.num_outputs_left
        limit = min(budget - 1, self.max_model_len - request.num_tokens,
                    (left if left is not None else budget) - 1)
        return self.proposer.propose(request.request_id, request.all_token_ids, limit)

    def _shift(self, request: Request) -> None:
        """Context shift (llama.cpp's and Ollama's): keep the first ``num_keep`` tokens, drop the older
        half of the rest, and recompute the request from there (its kept prefix from the prefix cache)."""
        request.all_token_ids = shifted_context(request.all_token_ids, self.num_keep(request),
                                                self.max_model_len)
        request.block_hashes = []
        request.metrics.num_context_shifts += 1
        self.num_context_shifts += 1
        self.running.remove(request)
        self._requeue(request)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)  # its n-gram index holds the old positions

    def num_keep(self, request: Request) -> int:
        return self.config.num_keep if request.params.num_keep is None else request.params.num_keep

    @property
    def shifts_context(self) -> bool:
        return self.config.context_overflow == "shift"

    def fit_prompt(self, prompt: list[int], num_keep: int | None, pooling: str | None = None) -> list[int]:
        """With context shift, a prompt too long for the context shifted as a context would be: the
        first ``num_keep`` tokens and the newest tokens that fill half the room after them. Otherwise
        (or when it fits, as a pooling prompt of the whole context does: it needs no room for a new
        token) the prompt as it is (``check_prompt`` refuses it if too long)."""
        if not self.shifts_context or len(prompt) <= self.prompt_room(pooling):
            return prompt
        keep = min(self.config.num_keep if num_keep is None else num_keep, self.max_model_len // 2)
        tail = (self.max_model_len - keep) // 2
        return prompt[:keep] + prompt[len(prompt) - tail :]

    def prompt_room(self, pooling: str | None) -> int:
        """The longest prompt the context holds: a pooling prompt may fill it, any other leaves room for
        one new token."""
        return self.max_model_len - (pooling is None)

    def _prefix_hits(self, request: Request) -> tuple[list, int]:
        """The request's cached prefix (blocks, tokens), not yet taken; none for a mean pooling request, which
        needs every position's state."""
        return self.kv.get_computed_blocks(request) if request.params.pooling != "mean" else ([], 0)

    def _schedule_suspect(self) -> SchedulerOutput:
        """One suspect alone (they all wait, see ``roll_back``), as much of it as the budget takes."""
        out = SchedulerOutput()
        request = next((r for r in self.waiting if r.request_id in self.suspects), None)
        if request is None:  # every suspect finished or was aborted
            self.suspects.clear()
            return self.schedule()
        hits, num_hit_tokens = self._prefix_hits(request)
        num_new = min(request.num_tokens - num_hit_tokens, self.config.max_num_batched_tokens)
        if not self.kv.allocate_slots(request, num_new, hits):
            # the pool is held by requests that are not suspects: run them as usual meanwhile
            suspects, self.suspects = self.suspects, set()
            try:
                return self.schedule()
            finally:
                self.suspects = suspects
        self.waiting.remove(request)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new))
        return out

    def roll_back(self, out: SchedulerOutput) -> None:
        """Undo a step whose forward failed: the blocks it was filling leave the prefix cache (their
        content is unknown), and its requests go back to waiting with nothing computed. With more
        than one request in the step, each is then run alone, so a request that fails by itself
        fails alone."""
        for s in out.scheduled:
            self.kv.forget_uncomputed(s.request)
        for s in reversed(out.scheduled):
            request = s.request
            if request in self.running:
                self.running.remove(request)
            self._requeue(request)
        if len(out.scheduled) > 1:
            self.suspects.update(s.request.request_id for s in out.scheduled)
            self.batch_cap = max(1, len(out.scheduled) // 2)

    def step_succeeded(self, out: SchedulerOutput) -> None:
        if self.suspects:
            self.suspects.difference_update(s.request.request_id for s in out.scheduled)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()  # the newest request goes first
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._requeue(request)
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)

    def _requeue(self, request: Request) -> None:
        """Back to the head of the queue with nothing computed: its blocks freed, to be run again."""
        self.kv.free(request)
        request.restart()
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance computed counts. Returns the requests whose last known token was computed this
        step: each of them gets one sampled token."""
        ready = []
        for s in out.scheduled:
            # drafts count once verified (the engine adds those it keeps)
            s.request.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids)
            if s.request.num_computed_tokens == s.request.num_tokens:
                ready.append(s.request)
        return ready
