"""``ServerConfig``: what the HTTP layer needs beyond the engine's own config."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str  # the name clients send in "model" (an Ollama ":latest" tag is accepted too)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every endpoint but /health and the docs needs it
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_n: int = 16  # most choices per OpenAI request (``n``)
    # special-token strings in chat messages become control tokens (trusted clients that build turns)
    special_tokens_in_messages: bool = False
    # a ZeroMQ address to publish the prefix cache's events on (server.kv_events)
    kv_events: str | None = None
    # thought tokens a reasoning model may write before its thought is closed for it (-1: no limit, 0: no
    # thinking); a request's own budget (Anthropic's thinking.budget_tokens) comes first
    reasoning_budget: int = -1
    # a streamed answer speaks at least this often while its prompt is read (Anthropic pings, SSE comments,
    # Ollama's empty lines): agents drop a stream that stays silent for minutes
    heartbeat_seconds: float = 5.0
    # the temperature of a request that sets none (llama.cpp's --temp); None: each API's own default
    # (OpenAI's and Anthropic's 1, Ollama's and llama.cpp's 0.8)
    temperature: float | None = None

    def temperature_for(self, asked: float | None, api_default: float) -> float:
        """A request's temperature: its own, else the server's, else its API's default."""
        if asked is not None:
            return asked
        return api_default if self.temperature is None else self.temperature

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the served model name must not be empty")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not self.heartbeat_seconds > 0:
            raise ValueError(
                f"the stream heartbeat must be a positive number of seconds, got {self.heartbeat_seconds}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"the body size limit must be at least 1 KiB, got {self.max_body_bytes} bytes")
