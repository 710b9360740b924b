"""What the OpenAI and Ollama request schemas share: unknown fields are refused, values must already
have the type the API documents, and fields we cannot honour are accepted only at a value that asks
for nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo


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
