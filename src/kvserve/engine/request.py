"""A request as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import numpy as np

from kvserve.engine.constraints import TokenConstraint
from kvserve.engine.outputs import RequestMetrics, TokenLogprob
from kvserve.engine.reasoning import ThoughtState
from kvserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    """Known tokens = prompt + generated. ``num_computed_tokens`` of them have K/V in the cache.

    Each step the scheduler gives a request some of its not-yet-computed tokens; when the computed
    count reaches the known count, the step's logits at the last token yield one new token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_total_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        shift_context: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache, set when first scheduled
        self.block_hashes: list[int] = []
        self.cache_salt = cache_salt
        self.eos_token_ids = eos_token_ids
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        # the HTTP status its error maps to: 400 where the request's own grammar failed
        self.error_status = 500
        self.num_step_failures = 0  # failed forwards this request was part of
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        limit = max_total_tokens
        if params.max_tokens is not None:
            limit = min(limit, len(prompt_token_ids) + params.max_tokens)
        self.max_total_tokens = limit
        self.shift_context = shift_context  # outgrowing the context shifts it (scheduler) instead of ending
        self.metrics = RequestMetrics(
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            num_prompt_tokens=len(prompt_token_ids),
        )
        self.generator: np.random.Generator | None = None  # created by the sampler on first use
        self.constraint: TokenConstraint | None = None  # params.constraint's state, set by the engine
        self.thought = ThoughtState(params.reasoning) if params.reasoning is not None else None
        # a pooling request (params.pooling): the mean's final hidden states so far, a tensor a chunk, then
        # the result
        self.pooled_rows: list[torch.Tensor] = []
        self.embedding: torch.Tensor | None = None  # [hidden] float32, once the whole prompt is read

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def restart(self) -> None:
        """Nothing computed any more (a preemption, a failed step): its K/V and pooled state start over."""
        self.num_computed_tokens = 0
        self.pooled_rows, self.embedding = [], None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> bool:
        """Finish on a stop token or a length limit; string stops are checked by the detokenizing side."""
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif last in self.params.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
        elif self.num_outputs_left is not None and self.num_outputs_left <= 0:  # max_tokens, or the context
            self.status = RequestStatus.FINISHED_LENGTH
        return self.is_finished

    @property
    def num_outputs_left(self) -> int | None:
        """Tokens it may still generate; None: no limit (a shifting context, no max_tokens)."""
        left = None if self.shift_context else self.max_total_tokens - self.num_tokens
        if self.params.max_tokens is not None:
            by_max_tokens = self.params.max_tokens - len(self.output_token_ids)
            left = by_max_tokens if left is None else min(left, by_max_tokens)
        return left
