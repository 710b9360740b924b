"""Pydantic models of the Ollama requests we accept.

Unknown fields and options are refused (400). Options that only matter when a model is loaded
(``num_gpu``, ``use_mmap``, ...) are accepted and ignored; sampling options we cannot honour are
accepted only with their no-op value (``typical_p: 1``, ``mirostat: 0``, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from kvserve.engine.constraints import Constraint
from kvserve.server import request_schema
from kvserve.server.request_schema import NonEmptyStr, Strict, Tokens
from kvserve.server.tools.definitions import ToolCall, ToolDefinition, closed_schema

DURATION_PATTERN = r"^-?([0-9]+(\.[0-9]+)?|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$"
DURATION = re.compile(DURATION_PATTERN)
KeepAlive = Annotated[str | float | None, WithJsonSchema(
    {"anyOf": [{"type": "string", "pattern": DURATION_PATTERN}, {"type": "number"}, {"type": "null"}]})]

NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "template": (None, ""),
    "format": (None, ""),
    "images": (None, []),
    "typical_p": (None, 1.0),
    "tfs_z": (None, 1.0),
    "mirostat": (None, 0),
}


neutral_only = request_schema.neutral_only(NEUTRAL_VALUES)


class Options(Strict):
    neutral_values = NEUTRAL_VALUES
    num_ctx: int | None = Field(None, ge=1)
    num_predict: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # -1: random, as in Ollama
    stop: list[NonEmptyStr] | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: Annotated[int | None, WithJsonSchema({"enum": [-1, 0, None]})] = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    num_batch: int | None = Field(None, ge=1)  # no effect: the engine batches by --max-num-batched-tokens
    # no-op values only
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    # tokens a context shift keeps (a server run with --context-overflow shift)
    num_keep: int | None = Field(None, ge=0)
    # ignored: no effect without mirostat, deprecated, or load-time settings of a model already loaded
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    numa: bool | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None

    check_neutral = field_validator("typical_p", "tfs_z", "mirostat")(neutral_only)

    @field_validator("num_predict")
    @classmethod
    def predict_values(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value not in (-1, -2):
            raise ValueError(
                "num_predict must be -1 (until the context is full), -2 (fill the context) or >= 1"
            )
        return value

    @field_validator("repeat_last_n")
    @classmethod
    def whole_context_only(cls, value: int | None) -> int | None:
        if value not in (None, -1, 0):
            raise ValueError("only -1 (the whole context) and 0 (no repeat penalty) are supported")
        return value

    @field_validator("stop")
    @classmethod
    def non_empty_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        return value


class GenerationFields(Strict):
    neutral_values = NEUTRAL_VALUES
    schema_rules = (request_schema.top_logprobs_need_logprobs(1),)
    model: str
    stream: bool | None = True
    options: Options | None = None
    keep_alive: KeepAlive = None  # validated, then ignored: the model stays loaded
    format: Annotated[Literal["json", ""] | dict[str, Any] | None, WithJsonSchema({"anyOf": [
        # any JSON, or a JSON schema
        {"enum": ["json", ""]}, request_schema.CLIENT_SCHEMA, {"type": "null"}]})] = None
    # a reasoning model's thought, on or off
    think: Annotated[bool | Literal["low", "medium", "high"] | None,
                     request_schema.needs("thinking", {"anyOf": [
        {"type": "boolean"}, {"enum": ["low", "medium", "high"]}, {"type": "null"}]},
        otherwise={"anyOf": [{"const": False}, {"type": "null"}]})] = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncate: bool | None = None  # a prompt longer than the context is refused either way (see errors)
    shift: bool | None = None  # context shift: a server setting here (--context-overflow)

    @property
    def thinking_switch(self) -> tuple[bool | None, str | None]:
        """(thinking on or off, None: the template's default; a level for templates that take one)."""
        if self.think is None:
            return None, None
        if isinstance(self.think, str):
            return True, self.think
        return self.think, None

    def format_constraint(self) -> Constraint | None:
        if not self.format:
            return None
        return Constraint("json_object") if self.format == "json" else Constraint.json_schema(
            closed_schema(self.format))

    @field_validator("keep_alive")
    @classmethod
    def duration(cls, value: str | float | None) -> str | float | None:
        if isinstance(value, str) and not DURATION.match(value.strip()):
            raise ValueError(f"not a duration: {value!r} (use e.g. 5m, 1h, 30s or -1)")
        return value

    @model_validator(mode="after")
    def top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class GenerateRequest(GenerationFields):
    schema_rules = (*GenerationFields.schema_rules, {  # raw: the prompt is all the model sees
        "if": {"required": ["raw"], "properties": {"raw": {"const": True}}},
        "then": {"properties": {"system": {"anyOf": [{"type": "null"}, {"maxLength": 0}]}}}})
    prompt: str | None = None
    system: str | None = None
    context: Tokens | None = None
    raw: bool | None = False
    # fill in the middle between prompt and suffix (a model with FIM tokens)
    suffix: Annotated[str | None,
                      request_schema.needs("fim", {"anyOf": [{"type": "string"}, {"type": "null"}]})] = None
    template: str | None = None
    images: list[Any] | None = None

    check_generate_neutral = field_validator("template", "images")(neutral_only)


class OllamaCalledFunction(Strict):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # sent by newer Ollama servers; ignored


class OllamaToolCallRecord(Strict):
    function: OllamaCalledFunction
    id: str | None = None  # what newer Ollama servers and litellm send back
    type: Literal["function"] | None = None


class Message(Strict):
    neutral_values = NEUTRAL_VALUES
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCallRecord] | None = None  # assistant turns
    thinking: str | None = None  # an earlier answer's thought, echoed back: not shown to the model
    tool_name: str | None = None  # tool turns: which tool answered
    tool_call_id: str | None = None  # tool turns: the call answered (litellm's ollama_chat/ sends it)

    check_neutral = field_validator("images")(neutral_only)

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [ToolCall(c.function.name, c.function.arguments,
                                              **({"id": c.id} if c.id else {}))
                                     for c in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatRequest(GenerationFields):
    messages: list[Message] | None = None
    tools: list[ToolDefinition] | None = None  # OpenAI's shape; the model chooses (no tool_choice)


class NamedModel(Strict):
    """A request that names one model, as ``model`` or (older clients) ``name``."""

    schema_rules = ({"anyOf": [{"required": [key], "properties": {key: {"type": "string", "minLength": 1}}}
                               for key in ("model", "name")]},)
    model: str | None = None
    name: str | None = None  # the older spelling

    @model_validator(mode="after")
    def names_a_model(self):
        if not self.model and not self.name:
            raise ValueError("model is required")
        return self

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""


class ShowRequest(NamedModel):
    verbose: bool | None = None


class PullRequest(NamedModel):
    insecure: bool | None = None  # Ollama's registry option; packages come from PyPI here
    stream: bool | None = None  # default true: NDJSON progress lines


class DeleteRequest(NamedModel):
    pass
