"""Tool calling for every API dialect (OpenAI's chat and Responses APIs, Ollama, Anthropic): what a tool
and a call are (``definitions``), how each model family writes a call (``call_formats``: Hermes, Qwen3
Coder's XML, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``), the grammar of an answer (``grammar``), tools
into the prompt (``prompts``) and calls back out of the answer (``calls``).

A dialect asks one question, ``ToolUse.decide``: given the tools a request offers, its tool choice and
the format of an answer that is not calls, which tools the model is shown, which grammar its answer
follows, and what the answer is read for calls against. Whatever the template, the output is constrained:
with ``required`` or a named tool it is one call (or several, when parallel calls are allowed) whose
arguments follow the tool's JSON schema; with ``auto`` it is either text (or the structured answer) or
calls, and a call still follows its schema.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.engine.constraints import Constraint
from kvserve.server.tools.call_formats import CallFormat
from kvserve.server.tools.calls import Calls, WrittenCalls, parse_calls, text_to_stream
from kvserve.server.tools.definitions import Tool, ToolCall, ToolChoice, ToolDefinition, check_tools
from kvserve.server.tools.grammar import call_constraint
from kvserve.server.tools.prompts import messages_for_template, template_takes_tools

__all__ = ["Calls", "Tool", "ToolCall", "ToolChoice", "ToolDefinition", "ToolUse", "ToolUseError",
           "WrittenCalls", "messages_for_template", "parse_calls", "template_takes_tools", "text_to_stream"]


class ToolUseError(ValueError):
    """A request's tools, or its answer format, that cannot be used; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request's tools mean for its answer: the tools the model is shown, the grammar the answer
    follows (None: free text), and what the answer is read for calls against (None: no tools offered)."""

    shown: list[Tool]
    constraint: Constraint | None
    calls: Calls | None

    @classmethod
    def decide(cls, tools: list[Tool], choice: ToolChoice, answer: Callable[[], Constraint | None],
               answer_param: str, fmt: CallFormat, written: WrittenCalls | None = None) -> ToolUse:
        """The tools checked against the choice, the answer's format built by ``answer`` (its ValueError
        a ``ToolUseError`` naming ``answer_param``), and one grammar of both in the family's form of a
        call (``fmt``). Raises ``ToolUseError`` naming "tools" for tools the choice cannot use."""
        try:
            check_tools(tools, choice)
        except ValueError as e:
            raise ToolUseError(str(e), "tools") from None
        try:
            answer_format = answer()
        except ValueError as e:
            raise ToolUseError(str(e), answer_param) from None
        shown = tools if choice.mode != "none" else []
        calls = Calls(fmt, shown, written) if shown else None
        return cls(shown, call_constraint(shown, choice, answer_format, fmt), calls)
