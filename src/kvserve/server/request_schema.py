"""What the OpenAI and Ollama request schemas share: unknown fields are refused, values must already
have the type the API documents, and fields we cannot honour are accepted only at a value that asks
for nothing."""

from __future__ import annotations

import functools
import logging
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, WithJsonSchema, model_validator

from kvserve.engine.constraints import UNENFORCED_KEYWORDS

log = logging.getLogger(__name__)

# Text and token lists that must not be empty (a stop sequence, a prompt), as the published schema says them
# (so a schema-valid request is never refused for being empty); the handlers' own checks refuse them with
# their own messages, and a lone surrogate still reaches the Unicode check that names it
NonEmptyStr = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]

# A bound of the running server's (``{LIMIT: "n"}``: at most ``--max-n``): ``openapi_docs`` fills the maximum
# in, as only the running server knows it; the handlers refuse values beyond it with their own message
LIMIT = "x-kvserve-limit"
# a token id: 0 ... the served vocabulary's last id
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, LIMIT: "token_id"}
Tokens = Annotated[list[int], WithJsonSchema({"type": "array", "items": TOKEN_ID_SCHEMA})]
NonEmptyTokens = Annotated[list[int],
                           WithJsonSchema({"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1})]

# A field the served model may not take: ``needs(feature, schema)`` publishes ``schema`` when the model has
# ``feature`` ("fim": fill-in-the-middle tokens, "thinking": a thought it writes first), else ``otherwise``
# (by default: the field must be left out); ``openapi_docs`` decides, as only the running server knows
NEEDS, OTHERWISE = "x-kvserve-needs", "x-kvserve-otherwise"


def needs(feature: str, schema: dict, otherwise: dict | None = None) -> WithJsonSchema:
    return WithJsonSchema({**schema, NEEDS: feature,
                           OTHERWISE: otherwise if otherwise is not None else {"not": {}}})


MAX_STOP = 16  # stop sequences a request may give
StopList = Annotated[list[NonEmptyStr], WithJsonSchema(
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP})]

# A token id as a string (logit_bias' keys): published with the pattern of the served vocabulary's ids
TOKEN_ID_KEY = "x-kvserve-token-id-key"

# A client's JSON Schema (a response format, a tool's parameters), published without the keywords the
# grammar engine cannot enforce; what the document cannot say (nested keywords, a schema nothing satisfies)
# is still a 400 from compiling it
CLIENT_SCHEMA = {"type": "object", "propertyNames": {"not": {"enum": list(UNENFORCED_KEYWORDS)}}}
ClientSchema = Annotated[dict[str, Any], WithJsonSchema(CLIENT_SCHEMA)]
OptionalClientSchema = Annotated[dict[str, Any] | None,
                                 WithJsonSchema({"anyOf": [CLIENT_SCHEMA, {"type": "null"}]})]
# A tool's parameters: any JSON schema; keywords the grammar cannot enforce are left out of the call's grammar
# unless the tool is strict (``tools.Tool``), where compiling it is the 400
ToolParameters = Annotated[dict[str, Any], WithJsonSchema({"type": "object"})]
OptionalToolParameters = Annotated[dict[str, Any] | None,
                                   WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "null"}]})]

# A tool's name as templates and call grammars take it (``tools.definitions.check_tools`` refuses others)
ToolName = Annotated[str, WithJsonSchema({"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"})]

STREAM_OPTIONS_NEED_STREAM = {  # the published rule that stream_options go with stream: true
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}


def tool_choice_needs_tools(forcing: dict) -> dict:
    """The published rule that a ``tool_choice`` matching ``forcing`` (one that forces a call) comes with
    tools."""
    return {"if": {"required": ["tool_choice"], "properties": {"tool_choice": forcing}},
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}


OPENAI_FORCING = {"anyOf": [{"const": "required"}, {"type": "object"}]}


def top_logprobs_need_logprobs(least: int) -> dict:
    """The published rule that ``top_logprobs`` of at least ``least`` asks for ``logprobs: true`` too."""
    return {"if": {"required": ["top_logprobs"],
                   "properties": {"top_logprobs": {"type": "integer", "minimum": least}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


def _publish(schema: dict[str, Any], model: type) -> None:
    """A request model's published schema: fields we cannot honour as the values that ask for nothing
    (``neutral_values``), and the rules between fields that JSON Schema can say (``schema_rules``)."""
    properties = schema.setdefault("properties", {})
    for name in sorted(getattr(model, "ignored_fields", ()) - model.model_fields.keys()):
        properties[name] = {"description": "accepted and ignored: it cannot change the answer"}
    for name, values in getattr(model, "neutral_values", {}).items():
        if name in properties:
            properties[name] = {"enum": list(values)}
    rules = getattr(model, "schema_rules", ())
    if rules:
        schema["allOf"] = list(rules)


_IGNORED_SEEN: set[tuple[str, str]] = set()


class Strict(BaseModel):
    """A request body: unknown fields are refused (a 400 naming them), values must have their documented
    type. ``ignored_fields``: fields that cannot change the tokens generated (metadata, client bookkeeping,
    cache hints), accepted and ignored, each logged once per name at debug level; those declared as fields
    still have their type checked, the others are taken with any value and dropped. ``neutral_values``:
    fields that would change the answer, accepted only at a value that asks for nothing."""

    # strict: no coercion, so "stream": "yes" or a token id of false is a 400, not true or token 0.
    # Both APIs' specs type these fields; their own servers refuse such values too. Integers still pass
    # where a number is expected (JSON does not tell 1 from 1.0).
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_publish)
    neutral_values: ClassVar[dict[str, tuple]] = {}
    schema_rules: ClassVar[tuple[dict, ...]] = ()
    ignored_fields: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not (present := cls.ignored_fields & data.keys()):
            return data
        for name in present:
            if (cls.__name__, name) not in _IGNORED_SEEN:
                _IGNORED_SEEN.add((cls.__name__, name))
                log.debug("%s: %r accepted and ignored (it cannot change the answer)", cls.__name__, name)
        untyped = present - cls.model_fields.keys()
        return {k: v for k, v in data.items() if k not in untyped} if untyped else data

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data: Any) -> Any:
        """JSON Schema's "integer" is any number without a fraction, so a schema-valid ``"n": 2.0`` is 2;
        2.5 and "2" are still refused."""
        if not isinstance(data, dict):
            return data
        names = _integer_fields(cls) & data.keys()
        return {**data, **{name: _integral(data[name]) for name in names}} if names else data


@functools.cache
def _integer_fields(model: type[BaseModel]) -> frozenset[str]:
    """The input names of a model's fields that take integers (or lists of them)."""
    return frozenset(field.alias or name for name, field in model.model_fields.items()
                     if _takes_int(field.annotation))


def _takes_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, typing.Annotated):
        return any(_takes_int(arg) for arg in typing.get_args(annotation))
    return False


def _integral(value: Any) -> Any:
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def neutral_only(neutral_values: dict[str, tuple]) -> Callable[[Any, ValidationInfo], Any]:
    """A field validator letting each field through only at one of its values in ``neutral_values``."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value not in neutral_values[info.field_name]:
            raise ValueError("not supported by this server; leave it out")
        return value

    return check
