"""What the engine hands back for a request after each step: one record for CLI, API and server."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token id, text, logprob)


@dataclass(slots=True)
class RequestMetrics:
    """Times in seconds (``time.perf_counter`` clock); rates in tokens per second."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_context_shifts: int = 0  # times the context outgrew the limit and was shifted
    num_draft_tokens: int = 0  # speculative tokens verified for this request
    num_accepted_tokens: int = 0  # of which kept
    itls: list[float] = field(default_factory=list)
    constrained: bool = False  # the output follows a grammar
    mask_times: list[float] = field(default_factory=list)  # seconds per grammar token mask

    def snapshot(self) -> RequestMetrics:
        """A copy the engine thread will not change under a reader on another thread."""
        return replace(self, itls=list(self.itls), mask_times=list(self.mask_times))

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def prefill_tok_s(self) -> float | None:
        ttft = self.ttft
        return self.num_prompt_tokens / ttft if ttft else None

    @property
    def decode_time(self) -> float:
        if self.first_token_time is None or self.last_token_time is None:
            return 0.0
        return self.last_token_time - self.first_token_time

    @property
    def decode_tok_s(self) -> float | None:
        t = self.decode_time
        return (self.num_generation_tokens - 1) / t if t > 0 and self.num_generation_tokens > 1 else None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """State of one request after a step. ``text`` and ``token_ids`` are cumulative; ``delta_text`` and
    ``new_token_ids`` are what this step added. ``finish_reason`` is "stop", "length", "abort" or
    "error". Nothing in it is shared with the engine's live request: readers may be on other threads."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    text: str
    delta_text: str
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_status: int = 500  # 400: the request's own grammar could not be followed (its fault, not ours)
    # a pooling request's pooled final hidden state ([hidden] float32, CPU)
    embedding: torch.Tensor | None = None
