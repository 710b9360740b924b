"""An app over a stub engine that raises what a test gives it: no model is loaded."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from fastapi.testclient import TestClient

from kvserve.engine.outputs import RequestMetrics, RequestOutput
from kvserve.kv.manager import KVCacheManager
from kvserve.server import ServerConfig, build_app
from kvserve.server.model_card import ModelCard


class StubTokenizer:
    chat_template = ""
    backend = SimpleNamespace(token_to_id=lambda token: None)  # no call marker is a token of its own
    thinks = False  # not a reasoning model
    max_token_bytes = 16
    fim = None

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "prompt"

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        if "explode" in text:
            raise RuntimeError(SECRET)
        return [1, 2, 3]

    def encode_chat(self, messages, add_generation_prompt=True, add_special=True, **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


class StubAsyncEngine:
    """Just what the server reads; ``generate`` fails the way it is told to."""

    def __init__(self, error: BaseException, after_first: bool = False) -> None:
        self.error = error
        self.after_first = after_first  # one token first, then the error (a stream ended mid-answer)
        self.dead_error = None
        self.num_pending_adds = 0
        self.lock = threading.Lock()
        self.engine = SimpleNamespace(
            tokenizer=StubTokenizer(),
            model_config=SimpleNamespace(vocab_size=100),
            max_model_len=64,
            kv=KVCacheManager(8, 4),
            scheduler=SimpleNamespace(running=[], waiting=[]),
            num_preemptions=0,
            num_draft_tokens=0,
            num_accepted_tokens=0,
            num_verify_steps=0,
            disk=None,  # no disk tier
        )

    async def generate(self, prompt, params=None, request_id=None, cache_salt=None, prepared=None):
        if self.after_first:
            yield RequestOutput(request_id or "r", (1,), "a", "a", [5], [5], False, None,
                                RequestMetrics(arrival_time=0.0, num_prompt_tokens=1))
        raise self.error

    def prompt_progress(self, request_id: str) -> None:
        return None  # not taken in: the stub never reads a prompt

    def shutdown(self, reason: str = "", timeout: float | None = None) -> None:
        pass


def make_client(
    error: BaseException, config: ServerConfig | None = None, after_first: bool = False
) -> tuple[TestClient, StubAsyncEngine]:
    card = ModelCard(
        name="stub",
        path=Path("stub.gguf"),
        architecture="llama",
        num_parameters=1,
        quantization="F32",
        size_bytes=1,
        context_length=64,
        kv_pool_bytes=1,
        device="cpu",
        modified=0.0,
        chat_template="",
    )
    engine = StubAsyncEngine(error, after_first)
    app = build_app(engine, config or ServerConfig(model_name="stub"), card)  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False), engine


SECRET = "secret-internal-detail"
