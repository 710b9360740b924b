"""Pydantic models of the Ollama replies we send, for the OpenAPI document only (as ``openai/chat_bodies``:
the handlers build dicts, these models say what they hold, and extra fields are forbidden so that an
undocumented field fails the schema tests)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

DoneReason = Literal["stop", "length", "load"]  # "load": an empty prompt, as Ollama answers it


class Exact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OllamaTopLogprob(Exact):
    token: str
    logprob: float
    bytes: list[int]


class OllamaLogprob(OllamaTopLogprob):
    top_logprobs: list[OllamaTopLogprob]


class Reply(Exact):
    """One NDJSON line of a streamed reply, or the whole reply with ``"stream": false``. The last line
    (``done: true``) carries the reason and the timings (nanoseconds)."""

    model: str
    created_at: str
    done: bool
    done_reason: DoneReason | None = None
    logprobs: list[OllamaLogprob] | None = None  # only when asked for
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class GenerateResponse(Reply):
    response: str
    thinking: str | None = None  # a reasoning model's thought (streamed: as it comes, before the answer)
    context: list[int] | None = None  # prompt and answer token ids, on the last line


class OllamaFunctionCall(Exact):
    index: int  # which call of the answer this is
    name: str
    arguments: dict


class OllamaToolCall(Exact):
    id: str
    function: OllamaFunctionCall


class OllamaMessage(Exact):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None  # a reasoning model's thought (streamed: as it comes, before the answer)
    tool_calls: list[OllamaToolCall] | None = None  # the answer's calls, in the line that ends it


class ChatResponse(Reply):
    message: OllamaMessage


class ModelDetails(Exact):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(Exact):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails


class LocalModel(ModelEntry):
    modified_at: str  # and size: bytes on disk


class Tags(Exact):
    models: list[LocalModel]


class RunningModel(ModelEntry):
    # size: bytes on disk plus the KV pool's
    expires_at: str
    size_vram: int
    context_length: int


class Ps(Exact):
    models: list[RunningModel]


class PullStatus(Exact):
    status: str  # "pulling manifest", "installing ...", "writing FILE", "verifying ...", "success"
    total: int | None = None  # bytes, while a file is written
    completed: int | None = None


class Show(Exact):
    modelfile: str
    parameters: str
    template: str  # the model's jinja2 chat template
    details: ModelDetails
    model_info: dict[str, str | int | float]
    capabilities: list[str]
    modified_at: str


class Version(Exact):
    version: str


class OllamaError(Exact):
    """Every Ollama-path error, and a stream's last line when the engine fails mid-stream."""

    error: str
