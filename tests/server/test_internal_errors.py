"""Failures inside the server, in-process over a stand-in engine (no model): a bug answers 500 in the
API's error shape without a traceback; a dead engine answers 503 and /health says so; every error
response is counted by the status it was sent with."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvserve.engine.async_engine import EngineDeadError, EngineShutdownError
from kvserve.engine.outputs import RequestMetrics, RequestOutput
from kvserve.engine.scheduler import QueueFullError
from kvserve.kv.manager import KVCacheManager
from kvserve.server import ServerConfig, build_app
from kvserve.server.model_card import ModelCard

SECRET = "secret-internal-detail"


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


CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
GENERATE = {"model": "stub", "prompt": "hi", "stream": False}


@pytest.mark.parametrize("body", [CHAT, {**CHAT, "stream": True}])
def test_a_bug_in_the_engine_is_a_500_without_details(body):
    client, _ = make_client(RuntimeError(SECRET))
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "internal server error" in error["message"]
    assert SECRET not in r.text and "Traceback" not in r.text


def test_a_bug_before_the_engine_is_a_500_in_ollama_shape():
    client, _ = make_client(RuntimeError("unused"))
    r = client.post("/api/generate", json={**GENERATE, "prompt": "explode"})
    assert r.status_code == 500 and set(r.json()) == {"error"}
    assert SECRET not in r.text and "Traceback" not in r.text


def test_a_dead_engine_is_503_and_unhealthy():
    client, engine = make_client(EngineDeadError("the engine stopped"))
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = client.post("/api/generate", json=GENERATE)
    assert r.status_code == 503 and "restart" in r.json()["error"]
    engine.dead_error = RuntimeError("boom")
    assert client.get("/health").status_code == 503


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/api/generate", GENERATE),
                                        ("/v1/messages", {**CHAT, "max_tokens": 4})])
def test_an_answer_ended_by_an_unload_is_a_503(path, body):
    """A stream ended mid-answer (its model unloaded, the server stopping) sent as one object: a 503 saying
    why, not a 500."""
    client, _ = make_client(EngineShutdownError("model 'stub' was unloaded (evicted); retry"),
                            after_first=True)
    r = client.post(path, json=body)
    assert r.status_code == 503 and "unloaded" in r.text and "internal" not in r.text


def test_internal_errors_are_counted():
    client, _ = make_client(RuntimeError(SECRET))
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
    r = client.get("/metrics")
    assert 'kvserve_request_errors_total{status="500"} 1.0' in r.text
    assert 'kvserve_request_errors_total{status="404"} 1.0' in r.text


def test_every_error_sent_is_counted_by_its_status():
    """Whoever answers: the middleware's 401, 413 and bad Content-Length 400 are counted too, and
    Ollama's answer to a full queue counts as the 503 it is, not as the 429 OpenAI gets."""
    config = ServerConfig(model_name="stub", api_key="key", max_body_bytes=1024)
    client, _ = make_client(QueueFullError("4 requests are waiting"), config)
    key = {"Authorization": "Bearer key"}
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/completions", content=b"x" * 2048, headers=key).status_code == 413
    bad_length = {**key, "Content-Length": "12x"}
    assert client.post("/v1/completions", content=b"{}", headers=bad_length).status_code == 400
    assert client.post("/api/generate", json={**GENERATE, "raw": True}, headers=key).status_code == 503
    completion = {"model": "stub", "prompt": [1, 2]}
    assert client.post("/v1/completions", json=completion, headers=key).status_code == 429
    assert client.get("/v1/nothing", headers=key).status_code == 404
    metrics = client.get("/metrics", headers=key).text
    for status in (400, 401, 404, 413, 429, 503):
        assert f'kvserve_request_errors_total{{status="{status}"}} 1.0' in metrics, status


def test_the_live_pool_behind_replicas_is_a_501_not_a_crash():
    """Behind --replicas the ingress has no pool of its own (ray_ingress.RemoteEngine): the live pool stream
    says so with a 501 in the API's error shape."""
    client, engine = make_client(RuntimeError("unused"))
    engine.serves_replicas = True
    r = client.get("/v1/kvserve/cache/stream", params={"max_events": 1})
    assert r.status_code == 501 and r.json()["error"]["code"] == "not_available"
    assert "replicas" in r.json()["error"]["message"]
