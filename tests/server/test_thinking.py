"""A reasoning model's thought on all four APIs, with a tiny random Qwen3 (as the architecture tests build
it) whose vocabulary and template think as Qwen3's do: ``<think>`` opened by the template unless thinking
is switched off (then an empty thought is written for the model). Its answers are noise, so what is
checked is the plumbing: the thought apart from the answer, streamed and not alike, closed at its budget
(the server's ``--reasoning-budget`` or Anthropic's ``budget_tokens``), and no thought when switched off."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import serve

pytestmark = pytest.mark.slow

BUDGET = 8  # the server's --reasoning-budget
CONTROL, USER_DEFINED = 3, 4
EXTRA = (("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL), ("<think>", USER_DEFINED),
         ("</think>", USER_DEFINED))
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    from tests.models.arch_builders import VOCAB, build_hf_model, write_gguf

    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-thinking.gguf"
    write_gguf(path, build_hf_model("qwen3", vocab=VOCAB + len(EXTRA)), "qwen3", extra_tokens=EXTRA,
               chat_template=TEMPLATE, eos_token_id=VOCAB + 1)
    yield from serve(tmp_path_factory, str(path), "-c", "512", "--reasoning-budget", str(BUDGET),
                     "--served-model-name", "thinker")


def _post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, headers=server.headers,
                      timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _openai(server, **extra) -> dict:
    body = {"model": "thinker", "messages": MESSAGES, "temperature": 0, "max_tokens": 24, **extra}
    return _post(server, "/v1/chat/completions", body).json()["choices"][0]


def test_openai_chat_separates_the_thought_and_closes_it_at_the_budget(thinker):
    choice = _openai(thinker, logprobs=True)
    thought, answer = choice["message"]["reasoning_content"], choice["message"]["content"]
    assert thought and "<think>" not in answer and "</think>" not in answer
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert tokens.index("</think>") == BUDGET  # the budget's tokens, then the close
    chunks = _sse(thinker, "/v1/chat/completions",
                  {"model": "thinker", "messages": MESSAGES, "temperature": 0,
                                                     "max_tokens": 24})
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    off = _openai(thinker, reasoning_effort="none")
    assert "reasoning_content" not in off["message"]


def test_ollama_think(thinker):
    body = {"model": "thinker", "messages": MESSAGES, "stream": False, "think": True,
            "options": {"temperature": 0, "num_predict": 24}}
    message = _post(thinker, "/api/chat", body).json()["message"]
    assert message["thinking"] == _openai(thinker)["message"]["reasoning_content"]
    lines = [json.loads(line) for line in httpx.post(f"{thinker.url}/api/chat", json={**body, "stream": True},
                                                     headers=thinker.headers, timeout=120).text.splitlines()]
    assert "".join(x["message"].get("thinking", "") for x in lines).strip() == message["thinking"]
    assert "".join(x["message"]["content"] for x in lines) == message["content"]
    off = _post(thinker, "/api/chat", {**body, "think": False}).json()["message"]
    assert "thinking" not in off
    generated = _post(thinker, "/api/generate", {"model": "thinker", "prompt": "Why?", "stream": False,
                                                 "options": {"temperature": 0, "num_predict": 24}}).json()
    assert generated["thinking"] and "</think>" not in generated["response"]


def test_anthropic_thinking_blocks_and_their_budget(thinker):
    body = {"model": "thinker", "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 3}}
    blocks = _post(thinker, "/v1/messages", body).json()["content"]
    assert blocks[0]["type"] == "thinking" and blocks[1]["type"] == "text"
    full = _openai(thinker)["message"]["reasoning_content"]
    assert len(blocks[0]["thinking"]) < len(full) and full.startswith(blocks[0]["thinking"])  # 3 tokens of 8
    events = _sse(thinker, "/v1/messages", body)
    thought = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "thinking_delta")
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    assert thought.strip() == blocks[0]["thinking"] and text == blocks[1]["text"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    off = _post(thinker, "/v1/messages", {**body, "thinking": {"type": "disabled"}}).json()["content"]
    assert [b["type"] for b in off] == ["text"]


def test_responses_reasoning_items(thinker):
    body = {"model": "thinker", "input": "Why is the sky blue?", "temperature": 0, "max_output_tokens": 24}
    r = _post(thinker, "/v1/responses", body).json()
    assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == BUDGET
    assert r["output"][0]["content"][0]["text"] == _openai(thinker)["message"]["reasoning_content"]
    events = _sse(thinker, "/v1/responses", body)
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta").strip() == \
        r["output"][0]["content"][0]["text"]
    off = _post(thinker, "/v1/responses", {**body, "reasoning": {"effort": "none"}}).json()
    assert [item["type"] for item in off["output"]] == ["message"]


def test_a_model_that_does_not_think(idle):
    headers = idle.headers
    r = httpx.post(f"{idle.url}/api/chat", headers=headers, json={"model": "smollm2", "messages": MESSAGES,
                                                                  "think": True, "stream": False})
    assert r.status_code == 400 and "does not support thinking" in r.text
    r = httpx.post(f"{idle.url}/v1/messages", headers=headers, json={
        "model": "smollm2", "messages": MESSAGES, "max_tokens": 4,
        "thinking": {"type": "enabled", "budget_tokens": 10}})
    assert r.status_code == 400
    r = httpx.post(f"{idle.url}/v1/chat/completions", headers=headers, json={
        "model": "smollm2", "messages": MESSAGES, "max_tokens": 4, "reasoning_effort": "high"})
    assert r.status_code == 200 and "reasoning_content" not in r.json()["choices"][0]["message"]
