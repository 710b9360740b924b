"""Draft tokens for speculative decoding by prompt lookup (n-gram matching, as llama.cpp's lookup
decoding and vLLM's ``ngram`` method): when a request's last n tokens occurred before in its own
prompt or output, the tokens that followed them then are proposed to follow now. Code edits,
summaries and quoting answers repeat their input, and there the guesses are often right.

A step verifies the drafts (see ``engine.LLMEngine.step``): each draft is attended as one more
decode row, so a verified token's logits are the same bits as without speculation, and the output is
the same tokens, sampled ones included (a draft is kept when the token drawn at its position equals
it, which keeps the target distribution: the draw is the draw decoding one token at a time makes).

Each request's n-grams are indexed as its tokens grow (a dict per n), so a proposal costs a few
dict lookups, not a scan of the context.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.config import SpeculativeConfig

MAX_BACKOFF = 16  # steps without drafts after a run of fully rejected ones, at most


class Proposer(Protocol):
    """What the scheduler asks for drafts (this module's prompt lookup, ``draft_model``'s draft model)."""

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]: ...

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


class _Index:
    __slots__ = ("backoff", "follows", "indexed", "skip", "width")

    def __init__(self, sizes: range, width: int) -> None:
        self.width = width  # drafts to propose next: follows how many the last ones kept
        self.indexed = 0  # positions < indexed have been entered as continuation starts
        self.follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.backoff = 0  # after drafts that were all rejected: steps to go without, doubling each time
        self.skip = 0  # steps left to go without drafts


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` tokens that may follow ``tokens``."""
        if limit < 1:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index(self.sizes, self.k)
        limit = min(index.width, limit)
        if index.skip:
            index.skip -= 1
            return []
        # a continuation starts at position e (< len(tokens): it has at least one token) after the
        # n tokens before it; later occurrences replace earlier ones (the most recent wins)
        for e in range(max(index.indexed, 1), len(tokens)):
            for n, follows in index.follows.items():
                if e >= n:
                    follows[tuple(tokens[e - n : e])] = e
        index.indexed = len(tokens)
        for n in reversed(self.sizes):  # the longest match first
            if len(tokens) > n:
                start = index.follows[n].get(tuple(tokens[-n:]))
                if start is not None:
                    return tokens[start : start + limit]
        return []

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """How a request's drafts fared. Each draft verified costs a row of the step whether it is kept
        or not (on two cores a step of 9 rows took ~4x one of 1), so the next proposal is as long as
        the last run of kept drafts plus one (twice as long after all were kept); and after drafts that
        were all rejected, as in a chat answer that does not repeat its context, the request goes
        without for 1, 2, 4 ... MAX_BACKOFF steps, until one is kept again."""
        index = self._indexes.get(request_id)
        if index is None:
            return
        if num_accepted == num_drafted:
            index.width = min(self.k, 2 * index.width)
        else:
            index.width = max(1, num_accepted + 1)
        index.backoff = 0 if num_accepted else min(MAX_BACKOFF, 2 * index.backoff or 1)
        index.skip = index.backoff

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
