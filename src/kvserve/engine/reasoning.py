"""A reasoning model's thought, followed token by token: where it opens and closes, and its budget.

Models such as Qwen3 and the DeepSeek-R1 distills write ``<think> ... </think>`` before the answer (or
their template opens the thought in the prompt). A request that carries ``Reasoning`` gets a
``ThoughtState``; the sampler asks it each step whether a token is forced (the thought has used its
budget: the closing tokens are written, one a step) and whether the request's grammar applies yet (a
grammar shapes the answer, never the thought). The state is rebuilt from the output tokens alone, so
preemption and speculative verification (which takes one token at a time) need nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reasoning:
    """``end``: the tokens that close a thought (forced when over budget); ``start``: those that open one,
    empty when the prompt has already opened it; ``budget``: thought tokens before ``end`` is forced (None:
    unlimited; 0 closes it at once)."""

    end: tuple[int, ...]
    start: tuple[int, ...] = ()
    budget: int | None = None

    def __post_init__(self) -> None:
        if not self.end:
            raise ValueError("a thought needs the tokens that close it")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"a thinking budget must be >= 0, got {self.budget}")


class ThoughtState:
    """Where a request's output stands: before a thought may open, inside it (``count`` tokens so far,
    ``matched`` of ``end`` written), or past it (also when the output started without one)."""

    BEFORE, INSIDE, DONE = "before", "inside", "done"

    def __init__(self, spec: Reasoning) -> None:
        self.spec = spec
        self.phase = self.INSIDE if not spec.start else self.BEFORE
        self.seen = 0  # output tokens read
        self.count = 0  # tokens inside the thought (its closing tokens included)
        self.matched = 0  # of spec.start while BEFORE, of spec.end while INSIDE

    def update(self, output: list[int]) -> None:
        for token in output[self.seen :]:
            self._take(token)
        self.seen = len(output)

    def _take(self, token: int) -> None:
        start, end = self.spec.start, self.spec.end
        if self.phase == self.BEFORE:
            if token == start[self.matched]:
                self.matched += 1
                if self.matched == len(start):
                    self.phase, self.matched = self.INSIDE, 0
            else:
                self.phase = self.DONE  # the answer began without a thought
        elif self.phase == self.INSIDE:
            self.count += 1
            if token == end[self.matched]:
                self.matched += 1
                if self.matched == len(end):
                    self.phase = self.DONE
            else:
                self.matched = 1 if token == end[0] else 0

    def forced(self) -> int | None:
        """The next token when the thought is over budget: the rest of ``end``."""
        budget = self.spec.budget
        if self.phase != self.INSIDE or budget is None or self.count - self.matched < budget:
            return None
        return self.spec.end[self.matched]

    @property
    def thought_tokens(self) -> int:
        """The thought's tokens, its closing tokens not counted."""
        closing = len(self.spec.end) if self.phase == self.DONE and self.count else self.matched
        return self.count - closing if self.phase != self.BEFORE else 0

    @property
    def answering(self) -> bool:
        """The answer has begun (a grammar applies from here)."""
        return self.phase == self.DONE


def split_thought(text: str, opened: bool, start: str = "<think>", end: str = "</think>") -> tuple[
    str | None, str]:
    """(the thought, the answer) of an output: ``opened`` when the prompt opened the thought, else a thought
    only where the output starts with ``start``. A thought never closed (cut off by the token limit) is all
    thought. None: no thought."""
    body = text
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(start):
            return None, text
        body = stripped[len(start) :]
    close = body.find(end)
    if close < 0:
        return body.strip(), ""
    return body[:close].strip(), body[close + len(end) :].lstrip()


def thought_so_far(text: str, opened: bool, start: str = "<think>",
                   end: str = "</think>") -> tuple[str | None, str, bool]:
    """For a stream: (the thought so far, the answer so far, settled). Text that may still become a tag
    (``"</thi"``, or a start that is not yet a whole ``<think>``) is held back: not settled."""
    if not opened:
        stripped = text.lstrip()
        if not stripped:
            return None, "", False
        if not stripped.startswith(start):
            if start.startswith(stripped):
                return None, "", False  # may yet be the start tag
            return None, text, True
    thought, answer = split_thought(text, opened, start, end)
    if answer or (thought is not None and end in text):
        return thought, answer, True
    body = thought or ""
    for k in range(len(end) - 1, 0, -1):  # a partial closing tag at the end waits
        if body.endswith(end[:k]):
            body = body[:-k]
            break
    return body, "", True
