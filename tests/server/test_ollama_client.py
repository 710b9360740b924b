"""The official ``ollama`` client against a live server: generate, chat, streaming, list, ps, show."""

from __future__ import annotations

import ollama
import pytest

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "num_predict": 8}
TIMINGS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers=server.headers, timeout=120)


def check_final(r, num_predict: int) -> None:
    assert r.done is True and r.done_reason in ("stop", "length")
    for field in TIMINGS:
        assert isinstance(r[field], int), field
    assert 1 <= r.eval_count <= num_predict and r.prompt_eval_count > 5
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration + r.load_duration > 0


def test_generate(client, idle):
    r = client.generate(model="smollm2", prompt="What is the capital of France?", options=GREEDY)
    assert "Paris" in r.response
    check_final(r, 8)
    assert r.context and len(r.context) == r.prompt_eval_count + r.eval_count


def test_generate_stream_matches_whole(client, idle):
    whole = client.generate(model="smollm2", prompt="Name a fruit.", options=GREEDY)
    parts = list(client.generate(model="smollm2", prompt="Name a fruit.", options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.response for p in parts) == whole.response
    check_final(parts[-1], 8)


def test_generate_raw_system_and_context(client, idle):
    raw = client.generate(model="smollm2", prompt="1, 2, 3, 4,", raw=True, options=GREEDY)
    assert raw.response.strip().startswith("5")
    assert raw.prompt_eval_count < 12  # no chat template around it
    system = client.generate(
        model="smollm2", prompt="Who are you?", system="You are a pirate.", options=GREEDY
    )
    assert system.prompt_eval_count > 10
    follow = client.generate(model="smollm2", prompt="And then?", context=raw.context, options=GREEDY)
    assert follow.prompt_eval_count > len(raw.context)


def test_chat(client, idle):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat(model="smollm2:latest", messages=messages, options=GREEDY)
    assert r.message.role == "assistant" and "Paris" in r.message.content
    check_final(r, 8)
    parts = list(client.chat(model="smollm2", messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    check_final(parts[-1], 8)


def test_options_map_onto_sampling(client, idle):
    opts = {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "min_p": 0.05,
        "seed": 3,
        "repeat_penalty": 1.2,
        "num_predict": 6,
        "num_ctx": 256,
        "num_batch": 64,
        "stop": ["\n\n"],
    }
    a = client.generate(model="smollm2", prompt="Tell me a story.", options=opts, keep_alive="5m")
    b = client.generate(model="smollm2", prompt="Tell me a story.", options=opts, keep_alive=-1)
    assert a.response == b.response and a.eval_count <= 6  # seeded: reproducible


def test_logprobs(client, idle):
    r = client.generate(model="smollm2", prompt="Hi", options=GREEDY, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == r.eval_count
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in r.logprobs)


def test_empty_prompt_answers_load(client):
    r = client.generate(model="smollm2", prompt="")
    assert r.done and r.done_reason == "load"


def test_list_ps_show(client):
    [m, embed] = client.list().models  # the chat model, and the embedding model beside it
    assert m.model == "smollm2:latest" and m.size > 10**7 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "llama"
    assert (
        embed.model == "all-minilm:latest"
        and embed.details.format == "safetensors"
        and embed.details.family == "bert"
    )
    assert embed.details.parameter_size == "22.7M"  # all-MiniLM-L6-v2's
    [p, embedding] = client.ps().models
    assert p.model == "smollm2:latest" and p.context_length == 512 and p.size > m.size
    assert embedding.model == "all-minilm:latest" and embedding.expires_at.year == 9999
    s = client.show("smollm2")
    assert s.modelinfo["general.architecture"] == "llama" and s.capabilities == ["completion", "tools"]
    assert "im_start" in s.template


def test_errors_raise_response_error(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="llama3", prompt="hi")
    assert e.value.status_code == 404 and "llama3" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="smollm2", prompt="hi", options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2", messages=[{"role": "user", "content": "hi"}], options={"num_ctx": 0})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
