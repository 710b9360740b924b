"""Pydantic models of the Anthropic Messages requests we accept (``/v1/messages``,
``/v1/messages/count_tokens``).

As on the other APIs: unknown fields are refused (400), values must have their documented type, and
fields we cannot honour are accepted only at a value that asks for nothing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from kvserve.engine.constraints import Constraint
from kvserve.server import request_schema
from kvserve.server.request_schema import Strict, ToolName
from kvserve.server.tools.definitions import Tool, ToolCall, ToolChoice, closed_schema

MAX_STOP = request_schema.MAX_STOP


class AnthropicText(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: our prefix cache needs no marks
    citations: list[Any] | None = None


class AnthropicToolUse(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolResult(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicText] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"error: {body}" if self.is_error else body


class AnthropicThought(Strict):
    """An earlier answer's thinking block, echoed back: not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = Annotated[AnthropicText | AnthropicToolUse | AnthropicToolResult | AnthropicThought,
                  Field(discriminator="type")]


def _no_blocks(role: str, block: str) -> dict:
    """The published rule that ``role``'s turns hold no ``block`` blocks."""
    not_block = {"not": {"required": ["type"], "properties": {"type": {"const": block}}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": not_block}]}
    return {"if": {"properties": {"role": {"const": role}}}, "then": {"properties": {"content": content}}}


class AnthropicMessage(Strict):
    """One turn. ``system``: a system turn mid-conversation (the mid-conversation-system beta Claude Code
    sends), rendered where it stands (``Serving.encode_chat`` merges it into the system prompt where the
    model's chat template takes no system turn there)."""

    schema_rules = (_no_blocks("user", "tool_use"), _no_blocks("assistant", "tool_result"),
                    _no_blocks("system", "tool_use"), _no_blocks("system", "tool_result"))
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    def for_template(self) -> list[dict[str, Any]]:
        """The chat-template messages this turn becomes: tool results are tool turns of their own."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "\n".join(b.text for b in self.content if isinstance(b, AnthropicText))
        calls = [ToolCall(b.name, b.input, b.id) for b in self.content if isinstance(b, AnthropicToolUse)]
        results = [b for b in self.content if isinstance(b, AnthropicToolResult)]
        if self.role != "user" and results:
            raise ValueError("tool_result blocks belong in user turns")
        if self.role != "assistant" and calls:
            raise ValueError("tool_use blocks belong in assistant turns")
        turns: list[dict[str, Any]] = [{"role": "tool", "content": r.text} for r in results]
        if text or not results:
            turn: dict[str, Any] = {"role": self.role, "content": text}
            if calls:
                turn["tool_calls"] = calls
            turns.append(turn)
        return turns


class AnthropicTool(Strict):
    # hints for Anthropic's own tool search and programmatic calling, streaming of a call's input, examples
    # shown to Anthropic's models: none changes the tokens generated here
    ignored_fields = frozenset({"eager_input_streaming", "defer_loading", "input_examples",
                                "allowed_callers"})
    name: ToolName
    description: str | None = None
    input_schema: request_schema.ToolParameters
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # true: every keyword of the schema enforced (a 400 where one cannot be)

    def tool(self) -> Tool:
        return Tool(self.name, self.description or "", self.input_schema, bool(self.strict))


class AnthropicToolChoice(Strict):
    schema_rules = ({"if": {"properties": {"type": {"const": "tool"}}},
                     "then": {"required": ["name"],
                              "properties": {"name": {"type": "string", "minLength": 1}}}},)
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def spec(self) -> ToolChoice:
        parallel = self.disable_parallel_tool_use is False  # asked for: see ToolChoice
        if self.type == "tool":
            if not self.name:
                raise ValueError("tool_choice of type 'tool' needs the tool's name")
            return ToolChoice("required", self.name, parallel)
        return ToolChoice({"any": "required"}.get(self.type, self.type), None, parallel)


class AnthropicThinking(Strict):
    type: Literal["disabled", "enabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)  # the thought's tokens before it is closed for the model
    display: Literal["summarized", "omitted"] | None = None  # the thought is always shown whole here


_THINKING = AnthropicThinking.model_json_schema()
# a model that does not think takes thinking disabled or adaptive (which then means disabled)
_NO_THINKING = {**_THINKING,
                "properties": {**_THINKING["properties"], "type": {"enum": ["disabled", "adaptive"]}}}


class AnthropicMetadata(Strict):
    user_id: str | None = None  # ignored


class AnthropicJSONFormat(Strict):
    type: Literal["json_schema"]
    schema_: request_schema.ClientSchema = Field(alias="schema")


class AnthropicOutputConfig(Strict):
    format: AnthropicJSONFormat | None = None  # the answer follows this JSON schema
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # ignored: no thinking here

    def constraint(self) -> Constraint | None:
        return Constraint.json_schema(closed_schema(self.format.schema_)) if self.format else None


class ContextEdit(Strict):
    """One of ``context_management.edits``: clearing earlier thinking blocks is what this server always does
    (a thought is never shown to the model again), so it changes nothing; clearing tool results would change
    the prompt and is not done here, so it is refused."""

    # the document says what the validator takes, so a client (or a fuzzer) reading it sends no other
    type: Annotated[str, Field(json_schema_extra={"pattern": "^clear_thinking_"})]
    keep: Any = None
    trigger: Any = None
    clear_at_least: Any = None
    exclude_tools: Any = None
    clear_tool_inputs: Any = None

    @field_validator("type")
    @classmethod
    def thinking_only(cls, value: str) -> str:
        if not value.startswith("clear_thinking_"):
            raise ValueError(f"context edits of type {value!r} are not supported by this server (it keeps "
                             "every tool result); leave them out")
        return value


class ContextManagement(Strict):
    edits: list[ContextEdit] = Field(default_factory=list)


BILLING_HEADER = "x-anthropic-billing-header:"


def _is_billing_header(block: AnthropicText) -> bool:
    """Claude Code's first system block: billing metadata for Anthropic's servers (its version and a hash
    that changes with each session's first message), not text meant for the model. Kept, it would sit in
    front of everything else and make every new session recompute its whole prompt."""
    text = block.text.strip()
    return text.startswith(BILLING_HEADER) and "\n" not in text


class CountTokensRequest(Strict):
    schema_rules = (request_schema.tool_choice_needs_tools(
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}}),)
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicText] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Annotated[AnthropicThinking | None, request_schema.needs(
        "thinking", {"anyOf": [_THINKING, {"type": "null"}]},
        {"anyOf": [_NO_THINKING, {"type": "null"}]})] = None
    context_management: ContextManagement | None = None

    @property
    def system_text(self) -> str:
        """The system prompt: the blocks' text, a leading billing-header block left out
        (``_is_billing_header``)."""
        if isinstance(self.system, list):
            blocks = self.system[1:] if self.system and _is_billing_header(self.system[0]) else self.system
            return "\n".join(b.text for b in blocks)
        return self.system or ""

    def template_messages(self) -> list[dict[str, Any]]:
        turns = [{"role": "system", "content": self.system_text}] if self.system_text else []
        for m in self.messages:
            turns.extend(m.for_template())
        return turns

    def tool_rules(self) -> tuple[list[Tool], ToolChoice]:
        tools = [t.tool() for t in self.tools or []]
        choice = self.tool_choice.spec() if self.tool_choice else ToolChoice("auto" if tools else "none")
        return tools, choice


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: request_schema.StopList | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    output_config: AnthropicOutputConfig | None = None
    metadata: AnthropicMetadata | None = None
    # accepted and ignored: they do not change the output (the prefix cache needs no marks)
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: None = None  # code execution containers: not here

    @field_validator("stop_sequences")
    @classmethod
    def stops(cls, value: list[str] | None) -> list[str] | None:
        if value and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(value)}")
        if value and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        return value


def input_json(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)
