"""The grammar of an answer that may hold tool calls: calls in the model family's form, each call's
arguments following its tool's JSON schema, beside text or a structured answer when the tool choice
allows them."""

from __future__ import annotations

import json
from typing import Any

from kvserve.engine.constraints import JSON_LAYOUT, Constraint
from kvserve.server.tools.call_formats import HERMES, CallFormat
from kvserve.server.tools.definitions import MAX_PARALLEL_CALLS, Tool, ToolChoice


def call_constraint(
    tools: list[Tool], choice: ToolChoice, answer: Constraint | None = None, fmt: CallFormat | None = None
) -> Constraint | None:
    """The grammar of the answer: None when the model may write anything (no tools, ``none``).
    ``answer``: the format of an answer that is not calls (a structured output alongside tools): with
    ``auto`` the answer is then calls or that JSON, never free text. ``fmt``: how the model family writes
    a call (``call_formats``; Hermes by default)."""
    if not tools or choice.mode == "none":
        return answer
    fmt = fmt or HERMES
    offered = [t for t in tools if choice.name is None or t.name == choice.name]
    max_calls = MAX_PARALLEL_CALLS if choice.parallel and choice.name is None else 1
    auto = choice.mode == "auto" and choice.name is None
    grammar = fmt.rules(offered, max_calls, bare=auto)
    if auto:
        if answer is not None:
            grammar.insert(0, "start: calls | answer")
            grammar.append(f"answer: %json {json.dumps(_answer_schema(answer))}")
        else:  # text that does not start a call; a call can only come first
            grammar.insert(0, "start: TEXT | calls")
            grammar.append(f"TEXT: {fmt.text_regex}")
    else:
        grammar.insert(0, "start: calls")
    return Constraint("lark", "\n".join(grammar))


def _answer_schema(answer: Constraint) -> dict[str, Any]:
    if answer.kind == "json_object":
        schema: Any = {"type": "object"}
    elif answer.kind == "json_schema":
        schema = json.loads(answer.spec)
        schema = schema if isinstance(schema, dict) else {}
    else:
        raise ValueError(f"a {answer.kind} answer format does not go with tools")
    return {**schema, "x-guidance": JSON_LAYOUT}
