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
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.constraints import Constraint

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # small models repeat a call until the token limit; the grammar ends them here


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode``: "auto", "required" or "none"; ``name`` set when one tool is forced."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True


def check_tools(tools: list[Tool], choice: ToolChoice) -> None:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    for tool in tools:
        if not tool.name or not all(c.isalnum() or c in "_-." for c in tool.name):
            raise ValueError(f"tool name {tool.name!r} must be letters, digits, '_', '-' or '.'")
        if not isinstance(tool.parameters, dict):
            raise ValueError(f"the parameters of tool {tool.name!r} must be a JSON schema object")
    if choice.name is not None and choice.name not in names:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    if choice.mode == "required" and not tools:
        raise ValueError("tool_choice 'required' needs at least one tool")


def call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_constraint(tools: list[Tool], choice: ToolChoice) -> Constraint | None:
    """The grammar of the answer: None when the model may write anything (no tools, ``none``)."""
    if not tools or choice.mode == "none":
        return None
    offered = [t for t in tools if choice.name is None or t.name == choice.name]
    schema = call_schema(offered[0]) if len(offered) == 1 else {"anyOf": [call_schema(t) for t in offered]}
    schema["x-guidance"] = {"whitespace_flexible": False}  # as Constraint's JSON: one line
    calls = f"call (NL call){{0,{MAX_PARALLEL_CALLS - 1}}}" if choice.parallel else "call"
    grammar = [
        f"calls: {calls}",
        f'call: "{CALL_OPEN}" NL %json {json.dumps(schema)} NL "{CALL_CLOSE}"',
        r'NL: "\n"',
    ]
    if choice.mode == "auto" and choice.name is None:
        # text that does not start a call; a call can only come first
        grammar.insert(0, "start: TEXT | calls")
        grammar.append(r"TEXT: /[^<](.|\n)*/")
    else:
        grammar.insert(0, "start: calls")
    return Constraint("lark", "\n".join(grammar))


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(text before the first call, the calls). Text that only looks like a call stays text."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    rest = text[start:]
    while rest.startswith(CALL_OPEN):
        end = rest.find(CALL_CLOSE)
        if end < 0:
            return text, []
        try:
            body = json.loads(rest[len(CALL_OPEN) : end])
        except json.JSONDecodeError:
            return text, []
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return text, []
        arguments = body.get("arguments", {})
        calls.append(ToolCall(body["name"], arguments if isinstance(arguments, dict) else {}))
        rest = rest[end + len(CALL_CLOSE) :].lstrip("\n")
    return text[:start].rstrip("\n"), calls if not rest.strip() else []


def text_to_stream(holding: bool, out) -> tuple[bool, str]:
    """(still holding, text to send now) for one output of a streamed answer that may be calls: the
    answer is held while it is empty or starts a call (a call can only come first, see
    ``call_constraint``); once it is text, what was held goes out, then each delta as it comes."""
    if not holding:
        return False, out.delta_text
    if out.text and not out.text.startswith(CALL_OPEN[0]):
        return False, out.text
    return True, ""


def render_call(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


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
