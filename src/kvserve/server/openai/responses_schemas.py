"""Pydantic models of OpenAI's Responses API requests (``POST /v1/responses``) and of what we answer.

The request's ``input`` is a string or a list of items: messages (``input_text`` / ``output_text`` parts),
earlier ``function_call`` items and their ``function_call_output``. They become the chat messages every
other API renders through the model's template (``for_template``). Unknown fields are refused; fields
that do not change the output are accepted and ignored.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, field_validator

from kvserve.engine.constraints import Constraint
from kvserve.server.request_schema import (
    OPENAI_FORCING,
    OptionalClientSchema,
    OptionalToolParameters,
    Strict,
    ToolName,
    tool_choice_needs_tools,
)
from kvserve.server.tools.definitions import (
    Tool,
    ToolCall,
    ToolChoice,
    echoed_arguments,
    format_constraint,
)


class FunctionTool(Strict):
    # hints to hosted tool search
    ignored_fields = frozenset({"defer_loading", "output_schema", "allowed_callers"})
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: OptionalToolParameters = None
    strict: bool | None = None  # true: every keyword of the schema enforced (a 400 where one cannot be)

    def tool(self) -> Tool:
        return Tool(self.name, self.description or "",
                    self.parameters or {"type": "object", "properties": {}}, bool(self.strict))


class NamespaceTool(Strict):
    """Tools grouped under a name (Codex's ``multi_agent_v1``): shown to the model flattened as
    ``namespace.tool``; a call to one comes back as ``name`` and ``namespace`` apart, as OpenAI sends it."""

    type: Literal["namespace"]
    name: ToolName
    description: str | None = None
    tools: list[FunctionTool]


class HostedTool(BaseModel):
    """A tool OpenAI runs on its own servers (``web_search``, ``file_search``, ``code_interpreter``, ...):
    there is none here, so it is left out of the prompt and the response says so in a ``Warning`` header."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace") else "hosted"


AnyTool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")]
                    | Annotated[HostedTool, Tag("hosted")], Discriminator(_tool_kind)]


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: OptionalClientSchema = Field(None, alias="schema")
    strict: bool | None = None

    def constraint(self) -> Constraint | None:
        return format_constraint(self.type, self.schema_)


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no effect on this server's models


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


def _text_of(content: Any) -> str:
    """A message's content: a string, or parts of text (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("message content must be a string or a list of text parts")  # noqa: TRY004 (a 400)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts are supported, got type {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}}}
_TEXT = {"anyOf": [{"type": "string"}, _TEXT_PARTS]}
# the input items served, as ``input_messages`` reads them
INPUT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": _TEXT}},
    {"type": "object", "required": ["type", "name", "call_id", "arguments"], "properties": {
        "type": {"const": "function_call"}, "name": {"type": "string"}, "call_id": {"type": "string"},
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": _TEXT}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}},
]}}]}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as template messages; ValueError names what is wrong with an item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}] must be an object")  # noqa: TRY004 (a 400)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message_input(i, item))
        elif kind == "function_call":
            _add_call(messages, _call_input(i, item))
        elif kind == "function_call_output":
            messages.append(_call_output_input(i, item))
        elif kind == "reasoning":
            continue  # an earlier answer's thought: not shown to the model again, as templates do
        else:
            raise ValueError(f"input[{i}]: items of type {kind!r} are not supported by this server")
    return messages


def _message_input(i: int, item: dict[str, Any]) -> dict[str, Any]:
    """A ``message`` item (``input[i]``) as a template turn: a developer's message is the system's."""
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ValueError(f"input[{i}].role must be user, system, developer or assistant, got {role!r}")
    return {"role": "system" if role == "developer" else role, "content": _text_of(item.get("content", ""))}


def _call_input(i: int, item: dict[str, Any]) -> ToolCall:
    """A ``function_call`` item (``input[i]``) as the call it echoes, named as its tool is shown."""
    name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, str):
        raise ValueError(  # noqa: TRY004 (a 400)
            f"input[{i}]: a function_call needs name, call_id and arguments (JSON text)")
    if isinstance(item.get("namespace"), str) and item["namespace"]:
        name = f"{item['namespace']}.{name}"  # as the namespace's tools are shown
    return ToolCall(name, echoed_arguments(arguments), call_id)


def _add_call(messages: list[dict[str, Any]], call: ToolCall) -> None:
    """A call joins the assistant turn just before it (parallel calls are one turn), or makes its own."""
    if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
        messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
    elif messages and messages[-1]["role"] == "assistant":
        messages[-1]["tool_calls"] = [call]
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output_input(i: int, item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call_output`` item (``input[i]``) as a tool turn answering its call."""
    output = item.get("output")
    if not isinstance(item.get("call_id"), str):
        raise ValueError(f"input[{i}]: a function_call_output needs its call_id")  # noqa: TRY004 (a 400)
    return {"role": "tool", "content": output if isinstance(output, str) else _text_of(output),
            "tool_call_id": item["call_id"]}


class ResponsesRequest(Strict):
    schema_rules = (tool_choice_needs_tools(OPENAI_FORCING),)
    model: str
    input: Annotated[str | list[dict[str, Any]], WithJsonSchema(INPUT_SCHEMA)]
    instructions: str | None = None
    tools: list[AnyTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    # accepted and ignored: they do not change the output
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=0)  # logprobs are not reported here
    max_tool_calls: int | None = Field(None, ge=1)
    background: Literal[False] | None = None
    ignored_fields = frozenset({"client_metadata"})  # Codex's turn and session ids

    def function_tools(self) -> list[Tool]:
        """The tools the model may call: functions, and each namespace's functions as ``namespace.tool``."""
        out = []
        for tool in self.tools or []:
            if isinstance(tool, FunctionTool):
                out.append(tool.tool())
            elif isinstance(tool, NamespaceTool):
                out += [replace(t.tool(), name=f"{tool.name}.{t.name}") for t in tool.tools]
        return out

    def hosted_tools(self) -> list[str]:
        return [tool.type for tool in self.tools or [] if isinstance(tool, HostedTool)]

    def namespaces(self) -> set[str]:
        return {tool.name for tool in self.tools or [] if isinstance(tool, NamespaceTool)}

    @field_validator("input")
    @classmethod
    def not_empty(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        return value

    def tool_choice_spec(self) -> ToolChoice:
        choice = self.tool_choice or ("auto" if self.tools else "none")
        parallel = self.parallel_tool_calls is True  # asked for: see ToolChoice
        if isinstance(choice, NamedFunction):
            return ToolChoice("required", choice.name, parallel)
        return ToolChoice(choice, None, parallel)


class ResponseObject(BaseModel):
    """The response as OpenAI's Responses API returns it (the fields clients read; more may come)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None  # none until the response is done
    incomplete_details: dict[str, str] | None
    previous_response_id: str | None


class ResponseEvent(BaseModel):
    """One event of a streamed response (``response.created``, ``response.output_text.delta``, ...,
    ``response.completed``; ``error``): its type, its place in the stream, and the type's own fields."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
    response: ResponseObject | None = None  # the events about the whole response carry it
