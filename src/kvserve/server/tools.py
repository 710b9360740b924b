"""Tool calling, shared by the OpenAI, Ollama and Anthropic APIs: tools into the prompt, calls out of
the output, and the grammar that keeps calls well formed.

A call is written as Hermes-style models (Qwen 2.5, Hermes, SmolLM3) write it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Templates that take ``tools`` get them; for the others (SmolLM2's, Gemma 3's) the tools are described in
the system message, earlier calls are written back in this form and tool results as
``<tool_response>`` user turns. Whatever the template, the output is constrained: with ``required`` or
a named tool it is one call (or several, when parallel calls are allowed) whose arguments follow the
tool's JSON schema; with ``auto`` it is either text or calls, and a call still follows its schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.engine.constraints import Constraint
from kvserve.server.call_formats import HERMES, CallFormat
from kvserve.server.tool_types import (
    CALL_CLOSE,
    CALL_OPEN,
    MAX_PARALLEL_CALLS,
    Tool,
    ToolCall,
    ToolChoice,
    render_call,
)


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
    grammar = fmt.rules(offered, max_calls)
    if choice.mode == "auto" and choice.name is None:
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
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True, slots=True)
class Calls:
    """What an answer's calls are read against: the model family's format and the tools offered."""

    fmt: CallFormat
    tools: list[Tool]


def parse_calls(text: str, calls: Calls | None = None) -> tuple[str, list[ToolCall]]:
    """(the text that is not calls, the calls) as the model family writes them (Hermes by default)."""
    return calls.fmt.parse(text, calls.tools) if calls is not None else HERMES.parse(text)


def text_to_stream(holding: bool, out, calls: Calls | None = None) -> tuple[bool, str]:
    """(still holding, text to send now) for one output of a streamed answer that may be calls: the
    answer is held while it is empty or may still become a call (a call can only come first, see
    ``call_constraint``); once it is text, what was held goes out, then each delta as it comes."""
    if not holding:
        return False, out.delta_text
    if out.text and not (calls.fmt if calls is not None else HERMES).may_start(out.text):
        return False, out.text
    return True, ""


def tools_prompt(tools: list[Tool]) -> str:
    listed = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False)
        for t in tools
    )
    return (
        "You can call these tools:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a tool, answer with one line per call, each as\n"
        f'{CALL_OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{CALL_CLOSE}\n'
        "and nothing else; the results come back in <tool_response> blocks."
    )


def messages_for_template(
    messages: list[dict[str, Any]], tools: list[Tool], template_takes_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables). Messages here are {"role", "content", optional
    "tool_calls": [ToolCall], optional "tool_call_id"}; tool turns become what the template reads."""
    if template_takes_tools:
        rendered = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [{"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}}
                         for c in m["tool_calls"]]
                rendered.append({**m, "tool_calls": calls})
            else:
                rendered.append(m)
        spec = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in tools]
        return rendered, ({"tools": spec} if tools else {})
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if m.get("tool_calls"):
            content = "\n".join([content, *(render_call(c) for c in m["tool_calls"])]).strip("\n")
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if m["role"] == "tool" and out and out[-1].get("tool_response"):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + content}  # parallel results: one turn
            continue
        out.append({"role": role, "content": content, "tool_response": m["role"] == "tool"})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template
