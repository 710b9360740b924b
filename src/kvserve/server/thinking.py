"""Reasoning models' thoughts on every API: the template's thinking switch from the request, the thought
split from the answer (whole or as it streams), and its budget handed to the engine (``Reasoning``).

Each API names it its way: OpenAI chat ``reasoning_effort`` -> ``reasoning_content``; the Responses API
``reasoning.effort`` -> a ``reasoning`` item; Ollama ``think`` -> ``thinking``; Anthropic ``thinking``
(with ``budget_tokens``) -> thinking blocks. A model that does not think ignores OpenAI's switches (as
llama.cpp does) and refuses Ollama's and Anthropic's explicit ``true`` (as those servers do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.reasoning import Reasoning, split_thought, thought_so_far
from kvserve.tokenizer import THINK_TAGS

START, END = THINK_TAGS


@dataclass(frozen=True, slots=True)
class Thinking:
    """One request's thought: ``opened`` when the prompt opened it; ``reasoning`` what the engine follows."""

    opened: bool
    reasoning: Reasoning

    def split(self, text: str) -> tuple[str | None, str]:
        return split_thought(text, self.opened, START, END)


def template_switch(enable: bool | None, effort: str | None = None) -> dict[str, Any]:
    """The chat template's variables for a request's choice (Qwen3's ``enable_thinking``, gpt-oss's
    ``reasoning_effort``); nothing when the request leaves it to the template."""
    variables: dict[str, Any] = {}
    if enable is not None:
        variables["enable_thinking"] = enable
    if effort is not None:
        variables["reasoning_effort"] = effort
    return variables


def thinking_for(tokenizer, prompt: list[int], enable: bool | None, budget: int | None) -> Thinking | None:
    """The request's thought, or None when the model does not think or thinking is off. ``budget``: the
    request's, else the server's (-1: none)."""
    if not tokenizer.thinks or enable is False:
        return None
    tail = tokenizer.decode(prompt[-32:], skip_special_tokens=False)
    opened = tail.rfind(START) > tail.rfind(END)
    end = tuple(tokenizer.encode(END, add_special=False))
    start = () if opened else tuple(tokenizer.encode(START, add_special=False))
    return Thinking(opened, Reasoning(end, start, None if budget is None or budget < 0 else budget))


class ThoughtStream:
    """Splits a streamed answer as it comes: ``feed(out)`` gives (new thought text, ``AnswerView`` of
    ``out`` with the answer's text and delta), holding back what may still become a tag."""

    def __init__(self, thinking: Thinking | None) -> None:
        self.thinking = thinking
        self.thought_sent = 0
        self.answer_sent = 0

    def feed(self, out: RequestOutput) -> tuple[str, AnswerView]:
        if self.thinking is None:
            return "", AnswerView(out, out.text, out.delta_text)
        thought, answer, _ = thought_so_far(out.text, self.thinking.opened, START, END)
        if out.finished:
            thought, answer = self.thinking.split(out.text)
        thought = thought or ""
        new_thought = thought[self.thought_sent :] if len(thought) > self.thought_sent else ""
        self.thought_sent = max(self.thought_sent, len(thought))
        delta = answer[self.answer_sent :] if len(answer) > self.answer_sent else ""
        self.answer_sent = max(self.answer_sent, len(answer))
        return new_thought, AnswerView(out, answer, delta)


class AnswerView:
    """An output as its answer alone: ``text`` and ``delta_text`` without the thought."""

    def __init__(self, out: RequestOutput, text: str, delta_text: str) -> None:
        self._out = out
        self.text = text
        self.delta_text = delta_text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)
