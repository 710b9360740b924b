"""The official ``openai`` client against a live server: chat and completions, streaming and not."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_chat_completion(client, idle):
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "smollm2"
    [choice] = r.choices
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client, idle):
    kw = {"model": "smollm2", "messages": QUESTION, "temperature": 0, "max_tokens": 10}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_repeated_prompt_reports_cached_tokens(client, idle):
    kw = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "List three colours. " * 4}],
        "temperature": 0,
        "max_tokens": 2,
    }
    client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_max_tokens_length_stop_and_ignore_eos(client, idle):
    r = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        temperature=0,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=12, stop=["Paris"]
    )
    assert "Paris" not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_n_choices_with_seed_are_reproducible(client, idle):
    kw = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Tell me a word."}],
        "n": 2,
        "seed": 7,
        "temperature": 1.0,
        "max_tokens": 6,
        "extra_body": {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1},
    }
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 12  # both choices' tokens
    single = client.chat.completions.create(**{**kw, "n": 1})
    assert a.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once, not n times


def test_logprobs(client, idle):
    r = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert bytes(entry.bytes).decode() == entry.token


def test_completions(client, idle):
    r = client.completions.create(
        model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=4, echo=True
    )
    assert r.object == "text_completion"
    assert r.choices[0].text.startswith("The capital of France is")
    stream = client.completions.create(
        model="smollm2", prompt=["1, 2, 3,", "a, b, c,"], temperature=0, max_tokens=4, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0].strip().startswith("4") and texts[1].strip().startswith("d")


def test_completion_logprobs_and_token_prompt(client, idle):
    r = client.completions.create(
        model="smollm2", prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=3, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)


def test_models(client):
    model, embedder = client.models.list().data  # the chat model, then the embedding model beside it
    assert model.id == "smollm2" and model.owned_by == "kvserve" and embedder.id == "all-minilm"
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_client_errors(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=QUESTION, top_p=0)
    assert e.value.body["param"] == "top_p"
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
