"""What a tool and a call are, shared by every API and by the call formats: tools as clients send
them, calls as models write them, and the JSON schemas of a call's arguments (closed as OpenAI's strict
mode reads them, with ``$defs`` lifted so that references resolve inside a larger grammar)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.engine.constraints import JSON_LAYOUT, UNENFORCED_KEYWORDS, Constraint
from kvserve.server.request_schema import OptionalToolParameters, Strict, ToolName

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # small models repeat a call until the token limit; the grammar ends them here


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call. ``strict``: the client asked for its schema to be enforced whole
    (OpenAI's and Anthropic's ``strict: true``), so keywords the grammar cannot enforce are a 400; otherwise
    they are left out of the call's grammar (the model still reads them in the prompt)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False


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


def _rewrite(schema: Any, ref: Any, loose: bool = False) -> Any:
    """A copy of ``schema`` with each object closed (``additionalProperties: false`` where the schema
    says nothing of other properties, as OpenAI's strict mode reads it) and each ``$ref`` through
    ``ref``. ``loose``: the keywords the grammar engine cannot enforce (``UNENFORCED_KEYWORDS``) left out,
    so the grammar admits a little more than the schema, never less."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if loose and key in UNENFORCED_KEYWORDS:
            continue
        if key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [_rewrite(v, ref, loose) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _rewrite(v, ref, loose) for k, v in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = _rewrite(value, ref, loose)
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
    if isinstance(parameters.get("defs"),
                  dict) and "$defs" not in parameters and "#/$defs/" in json.dumps(parameters):
        # the ollama client's Tool model renames $defs to "defs" (and drops a property's lone $ref): keep
        # what it kept resolvable
        parameters = {("$defs" if k == "defs" else k): v for k, v in parameters.items()}
    parameters = _rewrite(parameters, ref, loose=not tool.strict)
    defs = {k: parameters.pop(k) for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}
    schema = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **defs,
    }
    schema["x-guidance"] = JSON_LAYOUT  # as Constraint's JSON: one line, json.dumps' separators
    return schema


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object closed where it says nothing of other properties, as OpenAI's strict mode
    and llama.cpp's grammars read a schema: a small model given the choice adds properties until the token
    limit. References stay as they are."""
    return _rewrite(schema, lambda target: target)


def format_constraint(kind: str, schema: dict[str, Any] | None) -> Constraint | None:
    """The grammar of a structured answer (OpenAI's ``response_format`` and ``text.format`` types): none
    for text, any JSON object, or the closed schema (any object when none is given)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    return Constraint.json_schema(closed_schema(schema or {"type": "object"}))


def closed_parameters(tool: Tool) -> dict[str, Any]:
    """The tool's parameters schema, closed (and loosened) as ``call_schema`` does it."""
    return _rewrite(tool.parameters or {"type": "object"}, lambda target: target, loose=not tool.strict)


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


class FunctionDefinition(Strict):
    name: ToolName
    description: str | None = None
    parameters: OptionalToolParameters = None  # none: no arguments
    strict: bool | None = None  # true: every keyword of the schema enforced (a 400 where one cannot be)


class ToolDefinition(Strict):
    """A function tool as OpenAI's chat API and Ollama's take it."""

    type: Literal["function"]
    function: FunctionDefinition

    def tool(self) -> Tool:
        f = self.function
        return Tool(f.name, f.description or "", f.parameters or {"type": "object", "properties": {}},
                    bool(f.strict))
