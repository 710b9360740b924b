"""``kvserve serve`` of a GGUF model needs no torch: a server whose process cannot import it answers the
OpenAI, Ollama and Anthropic routes, streamed and not, and its metrics and cache views."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import serve


@pytest.fixture(scope="module")
def torchless(tmp_path_factory):
    yield from serve(tmp_path_factory, "smollm2", "-c", "512", "--max-num-seqs", "2", without_torch=True)


def test_every_api_answers_without_torch(torchless):
    with torchless.client() as c:
        chat = c.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"]
        with c.stream("POST", "/v1/completions", json={
                "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 6, "stream": True,
                "temperature": 0.8, "top_p": 0.9, "seed": 7}) as streamed:
            assert streamed.status_code == 200
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        ollama = c.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False,
                                               "options": {"num_predict": 4}})
        assert ollama.status_code == 200, ollama.text
        anthropic = c.post("/v1/messages", json={
            "model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert anthropic.status_code == 200, anthropic.text
        assert c.get("/metrics").status_code == 200
        cache = c.get("/v1/kvserve/cache")
        assert cache.status_code == 200 and json.loads(cache.text)["num_running"] == 0
    assert "Traceback" not in torchless.log.read_text()
