"""Every error the issue lists, in each API's own shape, with its real status code (live server).
The 500 path needs a broken engine, so it is tested in-process in ``test_internal_errors``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import MAX_BODY, MAX_NUM_SEQS, MAX_WAITING, NUM_CTX

pytestmark = pytest.mark.slow

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"model": "smollm2", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    return body["error"]


def ollama_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return body["error"]


@pytest.mark.parametrize(
    "change,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"logit_bias": {"fifty": 10}}, "logit_bias"),
        ({"logit_bias": {"50": 101}}, "logit_bias"),
        ({"best_guess": True}, "best_guess"),
        # values must already have their type: no "yes" for true, no 5.5 or true for an integer
        ({"stream": "yes"}, "stream"),
        ({"logprobs": 1}, "logprobs"),
        ({"max_tokens": 5.5}, "max_tokens"),
        ({"n": True}, "n"),
        ({"temperature": "0.5"}, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
    ],
)
def test_openai_invalid_parameters_are_400(server, change, param):
    with server.client() as c:
        error = openai_error(c.post("/v1/chat/completions", json={**CHAT, **change}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param)


@pytest.mark.parametrize(
    "change,word",
    [
        ({"options": {"temperature": -1}}, "temperature"),
        ({"options": {"top_k": -5}}, "top_k"),
        ({"options": {"num_predict": 0}}, "num_predict"),
        ({"options": {"repeat_last_n": 64, "repeat_penalty": 1.1}}, "repeat_last_n"),
        ({"options": {"typical_p": 0.5}}, "typical_p"),
        ({"options": {"no_such_option": 1}}, "no_such_option"),
        ({"format": "yaml"}, "format"),
        ({"format": {"type": "nonsense"}}, "json schema"),
        ({"images": ["aGk="]}, "images"),
        ({"keep_alive": "forever"}, "keep_alive"),
        ({"raw": True, "system": "be brief"}, "raw"),
        ({"context": [10**9]}, "out of range"),
        ({"stream": "yes"}, "stream"),
        ({"raw": 1}, "raw"),
        ({"context": [True]}, "context"),
        ({"options": {"num_predict": "5"}}, "num_predict"),
        ({"options": {"num_predict": 5.5}}, "num_predict"),
    ],
)
def test_ollama_invalid_parameters_are_400(server, change, word):
    with server.client() as c:
        assert word in ollama_error(c.post("/api/generate", json={**GENERATE, **change}), 400)


def test_integers_may_be_written_with_a_zero_fraction(server):
    """JSON Schema's "integer" is any number without a fraction: 2.0 is 2, as the published document allows
    (Python's json reads it as a float)."""
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2.0, "n": 1.0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 2
        r = c.post("/v1/completions", json={"model": "smollm2", "prompt": [[1.0, 2.0]], "max_tokens": 1})
        assert r.status_code == 200, r.text
        r = c.post("/api/generate", json={**GENERATE, "options": {"num_predict": 1.0}})
        assert r.status_code == 200 and r.json()["eval_count"] == 1, r.text


def test_text_of_no_tokens_completes_from_the_start_of_text(server):
    """A control character SmolLM2's tokenizer drops leaves no tokens: the completion starts from BOS, as
    an unconditioned one does, rather than refusing a request the document allows."""
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "smollm2", "prompt": "\x06", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1


@pytest.mark.parametrize("prompt", [[[False]], [1.5], [[1, "2"]], True, {"text": "hi"}])
def test_token_ids_are_integers(server, prompt):
    """Not a bool (false was token 0), not a float, not a string: the message says what prompt takes."""
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 1})
    error = openai_error(r, 400)
    assert error["param"] == "prompt"
    assert error["message"] == (
        "prompt: must be a string, a list of strings, a list of integers or a list of lists of integers"
    )


def test_malformed_bodies_are_400(server):
    with server.client() as c:
        openai_error(c.post("/v1/chat/completions", content=b"{not json"), 400)
        openai_error(c.post("/v1/chat/completions", json=[1, 2]), 400)
        openai_error(c.post("/v1/completions", json={"model": "smollm2", "prompt": []}), 400)
        ollama_error(c.post("/api/chat", content=b"{not json"), 400)


def test_unknown_model_is_404(server):
    with server.client() as c:
        assert (
            openai_error(c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404)["code"]
            == "model_not_found"
        )
        assert "llama3" in ollama_error(c.post("/api/generate", json={**GENERATE, "model": "llama3"}), 404)
        assert "llama3" in ollama_error(c.post("/api/show", json={"model": "llama3"}), 404)
        openai_error(c.get("/v1/models/gpt-4"), 404)


def test_prompt_longer_than_context_is_400_with_both_numbers(server):
    long_text = "hello " * (NUM_CTX + 50)
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": long_text}]}
        )
        error = openai_error(r, 400)
        assert error["code"] == "context_length_exceeded" and f"limit is {NUM_CTX} tokens" in error["message"]
        num_tokens = int(error["message"].split("the prompt is ")[1].split(" ")[0])
        assert num_tokens > NUM_CTX
        message = ollama_error(c.post("/api/generate", json={**GENERATE, "prompt": long_text}), 400)
        assert f"limit is {NUM_CTX} tokens" in message and "the prompt is" in message
        # a smaller per-request num_ctx is the limit then
        small = {**GENERATE, "prompt": "hello " * 40, "options": {"num_ctx": 32}}
        assert "limit is 32 tokens" in ollama_error(c.post("/api/generate", json=small), 400)


def test_several_prompts_are_admitted_together_or_not_at_all(idle):
    """A list of prompts (or n choices) is prepared and checked whole before any request is admitted: one
    prompt too long refuses them all, and the short one beside it never runs."""
    requests = 'kvserve_requests_total{finish_reason="length",model="smollm2"}'
    before = idle.metrics().get(requests, 0)
    with idle.client() as c:
        body = {"model": "smollm2", "prompt": [[5, 6, 7], [5] * (NUM_CTX + 20)], "max_tokens": 2, "n": 2}
        error = openai_error(c.post("/v1/completions", json=body), 400)
        assert error["code"] == "context_length_exceeded" and f"limit is {NUM_CTX} tokens" in error["message"]
        idle.wait_idle()
        assert idle.metrics().get(requests, 0) == before
        body["prompt"] = [[5, 6, 7], [8, 9]]  # the same request with room for all: four answers
        r = c.post("/v1/completions", json={**body, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert sorted(ch["index"] for ch in r.json()["choices"]) == [0, 1, 2, 3]
    assert idle.metrics()[requests] == before + 4


def test_body_too_large_is_413(server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    with server.client() as c:
        openai_error(c.post("/v1/chat/completions", json=big), 413)
        ollama_error(c.post("/api/generate", json={**GENERATE, "prompt": "x" * (MAX_BODY + 10)}), 413)

        def chunked():  # no Content-Length: the limit applies while the body streams in
            data = json.dumps(big).encode()
            for i in range(0, len(data), 8192):
                yield data[i : i + 8192]

        openai_error(c.post("/v1/chat/completions", content=chunked()), 413)


def test_missing_or_wrong_api_key_is_401(server):
    with httpx.Client(base_url=server.url) as c:
        r = c.get("/v1/models")
        assert openai_error(r, 401)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"  # RFC 9110: a 401 names its scheme
        r = c.get("/api/tags", headers={"Authorization": "Bearer nope"})
        ollama_error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200  # open, for load balancers


def test_unknown_path_and_method(server):
    with server.client() as c:
        openai_error(c.get("/v1/nothing"), 404)
        r = c.get("/api/generate")
        ollama_error(r, 405)
        assert r.headers["allow"] == "POST"  # RFC 9110: a 405 lists the methods that are
        r = c.delete("/v1/models")
        openai_error(r, 405)
        assert r.headers["allow"] == "GET"


def test_full_queue_is_429_for_openai_and_503_for_ollama(idle):
    """8 streams run, 4 wait (--max-waiting 4): the next request is refused until one leaves."""
    asyncio.run(_fill_the_queue(idle))


async def _fill_the_queue(server) -> None:
    long = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=120, limits=limits
    ) as c:
        responses, readers = [], []  # a reader dropped and collected would close its response
        try:
            for i in range(MAX_NUM_SEQS + MAX_WAITING):
                r = await c.send(c.build_request("POST", "/v1/chat/completions", json=long), stream=True)
                assert r.status_code == 200
                responses.append(r)
                if i < MAX_NUM_SEQS:  # wait for its first token: it is running, not waiting
                    readers.append(r.aiter_lines())
                    while '"content":""' in (line := await anext(readers[-1])) or not line:
                        pass
            snap = (await c.get("/v1/kvserve/cache")).json()
            assert snap["num_running"] == MAX_NUM_SEQS and snap["num_waiting"] == MAX_WAITING
            refused = await c.post("/v1/chat/completions", json={**long, "stream": False})
            assert openai_error(refused, 429)["code"] == "queue_full" and refused.headers["retry-after"]
            refused = await c.post("/api/generate", json=GENERATE)
            assert "busy" in ollama_error(refused, 503)
        finally:
            for r in responses:
                await r.aclose()
