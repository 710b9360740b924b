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
from typing import TYPE_CHECKING, Any

from kvserve.engine.constraints import Constraint

if TYPE_CHECKING:
    from kvserve.server.call_formats import CallFormat

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
    arguments: dict[str, Any] | str  # text only in a client's echo of arguments that are no JSON object
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode``: "auto", "required" or "none"; ``name`` set when one tool is forced. ``parallel``: several
    calls in one answer, only when the client asks (OpenAI's ``parallel_tool_calls: true``), as llama.cpp
    decides: small models given the choice write the same call again and again."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = False


def check_tools(tools: list[Tool], choice: ToolChoice) -> None:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    for tool in tools:
        if not tool.name or not all(c.isalnum() or c in "_-." for c in tool.name):
            raise ValueError(f"tool name {tool.name!r} must be letters, digits, '_', '-' or '.'")
        if not isinstance(tool.parameters, dict):
            raise ValueError(f"the parameters of tool {tool.name!r} must be a JSON schema object")  # noqa: TRY004
    if choice.name is not None and choice.name not in names:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    if choice.mode == "required" and not tools:
        raise ValueError("tool_choice 'required' needs at least one tool")


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems")


def _rewrite(schema: Any, ref: Any) -> Any:
    """A copy of ``schema`` with each object closed (``additionalProperties: false`` where the schema
    says nothing of other properties, as OpenAI's strict mode reads it) and each ``$ref`` through
    ``ref``."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [_rewrite(v, ref) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _rewrite(v, ref) for k, v in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = _rewrite(value, ref)
        elif key == "$ref" and isinstance(value, str):
            out[key] = ref(value)
        else:
            out[key] = value
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and not {"additionalProperties", "unevaluatedProperties",
                                                    "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def call_schema(tool: Tool) -> dict[str, Any]:
    """One call's JSON: {"name": the tool's, "arguments": its parameters}. The parameters' local
    references are re-rooted at ``arguments`` (their ``$defs`` hoisted to the call's root), so a pydantic
    model's nested models resolve inside the call as they did in the tool."""

    def ref(target: str) -> str:
        if target.startswith(("#/$defs/", "#/definitions/")):
            return target
        if target == "#" or target.startswith("#/"):
            return "#/properties/arguments" + target[1:]
        return target

    parameters = tool.parameters or {"type": "object"}
    if isinstance(parameters.get("defs"), dict) and "$defs" not in parameters and "#/$defs/" in json.dumps(parameters):
        # the ollama client's Tool model renames $defs to "defs" (and drops a property's lone $ref): keep
        # what it kept resolvable
        parameters = {("$defs" if k == "defs" else k): v for k, v in parameters.items()}
    parameters = _rewrite(parameters, ref)
    defs = {k: parameters.pop(k) for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}
    schema = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **defs,
    }
    schema["x-guidance"] = {"whitespace_flexible": False}  # as Constraint's JSON: one line
    return schema


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object closed where it says nothing of other properties, as OpenAI's strict mode
    and llama.cpp's grammars read a schema: a small model given the choice adds properties until the token
    limit. References stay as they are."""
    return _rewrite(schema, lambda target: target)


def closed_parameters(tool: Tool) -> dict[str, Any]:
    """The tool's parameters schema, closed as ``call_schema`` closes it."""
    return closed_schema(tool.parameters or {"type": "object"})


def call_constraint(
    tools: list[Tool], choice: ToolChoice, answer: Constraint | None = None, fmt: CallFormat | None = None
) -> Constraint | None:
    """The grammar of the answer: None when the model may write anything (no tools, ``none``).
    ``answer``: the format of an answer that is not calls (a structured output alongside tools): with
    ``auto`` the answer is then calls or that JSON, never free text. ``fmt``: how the model family writes
    a call (``call_formats``; Hermes by default)."""
    if not tools or choice.mode == "none":
        return answer
    fmt = fmt or _hermes()
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


def _hermes() -> CallFormat:
    from kvserve.server.call_formats import HERMES

    return HERMES


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
    return calls.fmt.parse(text, calls.tools) if calls is not None else _hermes().parse(text)


def text_to_stream(holding: bool, out, calls: Calls | None = None) -> tuple[bool, str]:
    """(still holding, text to send now) for one output of a streamed answer that may be calls: the
    answer is held while it is empty or may still become a call (a call can only come first, see
    ``call_constraint``); once it is text, what was held goes out, then each delta as it comes."""
    if not holding:
        return False, out.delta_text
    if out.text and not (calls.fmt if calls is not None else _hermes()).may_start(out.text):
        return False, out.text
    return True, ""


def echoed_arguments(text: str) -> dict[str, Any] | str:
    """A client's echo of an earlier call's arguments (JSON text): the object, or the text as it came when it
    is no JSON object (a model's malformed call sent back), which templates print as it is, as OpenAI,
    whose API takes any text there, would show it."""
    try:
        parsed = json.loads(text or "{}")
    except json.JSONDecodeError:
        return text
    return parsed if isinstance(parsed, dict) else text


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
