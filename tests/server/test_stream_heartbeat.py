"""Streams that speak while a long prompt is read: each API's opening event at once, then a ping (Anthropic's
``ping`` event, an SSE comment, Ollama's empty line) every ``--stream-heartbeat`` seconds until the first
token, and llama.cpp's ``prompt_progress`` chunks when asked (``return_progress``). Agents drop a stream that
stays silent for minutes; a cold agent prompt takes that long on a small CPU."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import serve

pytestmark = pytest.mark.slow

HEARTBEAT = 0.05
_TEXT = "The quick brown fox jumps over the lazy dog. " * 150  # ~1,500 tokens: longer than many heartbeats
_asked = iter(range(1_000_000))


def long_prompt() -> str:
    """A prompt no earlier one shares a prefix with (the cache would read it in no time)."""
    return f"Text {next(_asked)}: {_TEXT}"


@pytest.fixture(scope="module")
def slow_reader(tmp_path_factory):
    yield from serve(tmp_path_factory, "smollm2", "-c", "2048", "-t", "1", "--stream-heartbeat",
                     str(HEARTBEAT))


def _lines(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def _before_output(lines: list[str], is_output) -> list[str]:
    return lines[: next(i for i, line in enumerate(lines) if is_output(line))]


def test_anthropic_sends_message_start_then_pings(slow_reader):
    lines = _lines(slow_reader, "/v1/messages", {"model": "smollm2", "max_tokens": 4, "stream": True,
                                                 "messages": [{"role": "user", "content": long_prompt()}]})
    head = _before_output(lines, lambda line: line == "event: content_block_start")
    assert head[0] == "event: message_start"
    assert head.count("event: ping") >= 3


def test_openai_chat_and_completions_send_comments_or_progress(slow_reader):
    def content(line: str) -> bool:
        return (
            line.startswith("data: ")
            and '"content":"' in line
            and '"content":""' not in line
            or '"text":"' in line
        )

    def chat() -> dict:
        return {"model": "smollm2", "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": long_prompt()}]}

    head = _before_output(_lines(slow_reader, "/v1/chat/completions", chat()), content)
    assert '"role":"assistant"' in head[0] and head.count(": ping") >= 3
    head = _before_output(_lines(slow_reader, "/v1/completions",
                                 {"model": "smollm2", "max_tokens": 4, "stream": True,
                                                                   "prompt": long_prompt()}), content)
    assert head[0] == ": ping" and head.count(": ping") >= 3
    head = _before_output(_lines(slow_reader, "/v1/chat/completions", {**chat(), "return_progress": True}),
                          content)
    progress = [json.loads(line[6:])["prompt_progress"] for line in head if "prompt_progress" in line]
    assert progress, head
    assert all(p["total"] > 1000 and 0 <= p["cache"] <= p["processed"] <= p["total"] for p in progress)
    assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)


def test_responses_and_ollama_speak_too(slow_reader):
    lines = _lines(slow_reader, "/v1/responses",
                   {"model": "smollm2", "input": long_prompt(), "max_output_tokens": 4,
                                                   "stream": True})
    head = _before_output(lines, lambda line: "output_text.delta" in line)
    assert head[0] == "event: response.created" and head.count(": ping") >= 3
    lines = _lines(slow_reader, "/api/chat",
                   {"model": "smollm2", "messages": [{"role": "user", "content": long_prompt()}],
                                              "options": {"num_predict": 4}})
    parts = [json.loads(line) for line in lines]
    empty = _before_output(parts, lambda p: p["message"]["content"] or p["done"])
    assert len(empty) >= 3 and all(p["message"] == {"role": "assistant", "content": ""} for p in empty)
