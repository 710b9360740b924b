"""What the OpenAI and Ollama request schemas share: unknown fields are refused, values must already
have the type the API documents, and fields we cannot honour are accepted only at a value that asks
for nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, WithJsonSchema

# Text and token lists that must not be empty (a stop sequence, a prompt), as the published schema says them
# (so a schema-valid request is never refused for being empty); the handlers' own checks refuse them with
# their own messages, and a lone surrogate still reaches the Unicode check that names it
NonEmptyStr = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]
NonEmptyTokens = Annotated[list[int], WithJsonSchema({"type": "array", "items": {"type": "integer"}, "minItems": 1})]


class Strict(BaseModel):
    # strict: no coercion, so "stream": "yes" or a token id of false is a 400, not true or token 0.
    # Both APIs' specs type these fields; their own servers refuse such values too. Integers still pass
    # where a number is expected (JSON does not tell 1 from 1.0).
    model_config = ConfigDict(extra="forbid", strict=True)


def neutral_only(neutral_values: dict[str, tuple]) -> Callable[[Any, ValidationInfo], Any]:
    """A field validator letting each field through only at one of its values in ``neutral_values``."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value not in neutral_values[info.field_name]:
            raise ValueError("not supported by this server; leave it out")
        return value

    return check
