"""The official ``anthropic`` client against a live server: messages, streaming events, tool_use
blocks, a multi-turn exchange with a tool result, token counting, and Anthropic's error shapes."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.tool_cases import ADD, WEATHER

pytestmark = pytest.mark.slow

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "add", "description": "Add two integers", "input_schema": ADD},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120)


def test_a_message_and_its_usage(client, idle):
    r = client.messages.create(model="smollm2", max_tokens=12, extra_body={"temperature": 0},
                               system="Be brief.",
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.content[0].type == "text" and "Paris" in r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= r.usage.output_tokens <= 12 and r.usage.input_tokens > 10
    again = client.messages.create(model="smollm2", max_tokens=12, extra_body={"temperature": 0},
                                   system="Be brief.",
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert again.content[0].text == r.content[0].text
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache served the repeated prompt
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == r.usage.input_tokens + \
        r.usage.cache_read_input_tokens


def test_a_streamed_answer_equals_the_whole_one(client, idle):
    kw = {"model": "smollm2", "max_tokens": 16, "extra_body": {"temperature": 0}, "messages": ASK}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason


def test_stop_sequences_say_which_one_stopped(client, idle):
    r = client.messages.create(model="smollm2", max_tokens=30, extra_body={"temperature": 0}, messages=ASK,
                               stop_sequences=["Paris", "weather"])
    if r.stop_reason == "stop_sequence":
        assert r.stop_sequence in ("Paris", "weather")


def test_tool_use_blocks_validate_streamed_or_not(client, idle):
    kw = {"model": "smollm2", "max_tokens": 80, "extra_body": {"temperature": 0}, "messages": ASK,
          "tools": TOOLS,
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    r = client.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    [use] = [b for b in r.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name in SCHEMAS
    jsonschema.validate(use.input, SCHEMAS[use.name])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input) and final.stop_reason == "tool_use"
    named = client.messages.create(**{**kw,
                                      "tool_choice": {"type": "tool", "name": "add",
                                                      "disable_parallel_tool_use": True}})
    uses = [b for b in named.content if b.type == "tool_use"]
    assert uses and all(b.name == "add" for b in uses)
    for b in uses:
        jsonschema.validate(b.input, ADD)


def test_a_tool_result_is_answered(client, idle):
    messages = [
        *ASK,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user",
         "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 degrees"},
                                     {"type": "text", "text": "So, should I take a coat?"}]},
    ]
    r = client.messages.create(model="smollm2", max_tokens=20, extra_body={"temperature": 0},
                               messages=messages, tools=TOOLS)
    assert r.content and r.usage.input_tokens + r.usage.cache_read_input_tokens > 60
    count = client.messages.count_tokens(model="smollm2", messages=messages, tools=TOOLS)
    assert count.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens


def test_output_config_format_answers_validate(client, idle):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    for seed in range(3):
        r = client.messages.create(model="smollm2", max_tokens=60,
                                   messages=[{"role": "user", "content": "A person."}],
                                   output_config={"format": {"type": "json_schema", "schema": person}},
                                   extra_body={"temperature": 1.0, "top_k": 40 + seed})
        assert r.stop_reason == "end_turn"
        jsonschema.validate(json.loads(r.content[0].text), person)


def test_errors_have_anthropics_shape(client, server, idle):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smollm2", max_tokens=4, messages=ASK, extra_body={"temperature": 3})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "smollm2", "messages": ASK, "max_tokens": 4,
                                                       "thinking": {"type": "enabled", "budget_tokens": 100}},
                   headers={"x-api-key": server.api_key})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "smollm2", "messages": ASK, "max_tokens": 4})
    error = r.json()["error"]
    assert r.status_code == 401 and r.json() == {
        "type": "error", "error": {"type": "authentication_error", "message": error["message"]}}
