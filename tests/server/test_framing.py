"""Wire format, byte for byte where it matters: SSE events and NDJSON lines, read with plain httpx."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

CHAT = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Say hi."}],
    "temperature": 0,
    "max_tokens": 6,
}


def sse_events(body: str) -> list[str]:
    """Each event is exactly 'data: <payload>' followed by a blank line; SSE comments (': ping', sent while a
    prompt is read) are framed the same way and left out."""
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    for event in events:
        assert (event.startswith("data: ") or event == ": ping") and "\n" not in event, repr(event)
    return [e.removeprefix("data: ") for e in events if e != ": ping"]


def test_chat_sse_framing(idle):
    with idle.client() as c:
        r = c.post(
            "/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "smollm2"
    first = chunks[0]["choices"][0]
    assert first == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    for chunk in chunks[1:-2]:
        [choice] = chunk["choices"]
        assert set(choice["delta"]) == {"content"} and choice["finish_reason"] is None
        assert chunk["usage"] is None
    last_choice = chunks[-2]["choices"][0]
    assert last_choice["delta"] == {} and last_choice["finish_reason"] in ("stop", "length")
    usage = chunks[-1]
    assert usage["choices"] == []
    assert set(usage["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_chat_sse_without_usage_has_no_usage_field(idle):
    with idle.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True, "n": 2})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in chunk and len(chunk["choices"]) == 1 for chunk in chunks)
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
    assert finished == [0, 1]


def test_completion_sse_framing(idle):
    body = {
        "model": "smollm2",
        "prompt": "1, 2, 3,",
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with idle.client() as c:
        r = c.post("/v1/completions", json=body)
    events = sse_events(r.text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "path,body,key",
    [
        (
            "/api/generate",
            {"model": "smollm2", "prompt": "Say hi.", "options": {"temperature": 0, "num_predict": 5}},
            "response",
        ),
        (
            "/api/chat",
            {
                "model": "smollm2",
                "messages": [{"role": "user", "content": "Say hi."}],
                "options": {"temperature": 0, "num_predict": 5},
            },
            "message",
        ),
    ],
)
def test_ndjson_framing_streams_by_default(idle, path, body, key):
    with idle.client() as c:
        r = c.post(path, json=body)
        whole = c.post(path, json={**body, "stream": False})
    assert r.headers["content-type"] == "application/x-ndjson"
    assert r.text.endswith("\n")
    lines = [json.loads(line) for line in r.text[:-1].split("\n")]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"] is True
    assert all(line["model"] == "smollm2" and line["created_at"].endswith("Z") for line in lines)
    final = lines[-1]
    for field in (
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
        "done_reason",
    ):
        assert field in final
    assert ("context" in final) == (path == "/api/generate")
    text = "".join(line[key] if key == "response" else line[key]["content"] for line in lines)
    assert whole.headers["content-type"] == "application/json"
    one = whole.json()
    assert one["done"] is True and (one[key] if key == "response" else one[key]["content"]) == text


def test_openapi_spec_and_health(server):
    with server.client() as c:
        spec = c.get("/openapi.json").json()
        assert c.get("/health").json() == {"status": "ok", "model": "smollm2", "loaded": ["smollm2"]}
        assert c.get("/api/version").json()["version"]
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/api/generate",
        "/api/chat",
        "/api/tags",
        "/api/ps",
        "/api/show",
        "/api/version",
        "/health",
        "/metrics",
    ):
        assert path in spec["paths"], path
