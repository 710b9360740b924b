"""Failures inside the server, in-process over a stand-in engine (no model): a bug answers 500 in the
API's error shape without a traceback; a dead engine answers 503 and /health says so; every error
response is counted by the status it was sent with."""

from __future__ import annotations

import pytest

from kvserve.engine.async_engine import EngineDeadError, EngineShutdownError
from kvserve.engine.scheduler import QueueFullError
from kvserve.server import ServerConfig
from tests.server.stub_engine import SECRET, make_client

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
