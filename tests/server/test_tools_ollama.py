"""The official ``ollama`` client with ``format`` and ``tools``: schema-valid answers, tool calls whose
arguments validate (streamed or not), and a tool result answered."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.server.tool_cases import ASK, SCHEMAS, TOOLS

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers=server.headers, timeout=120)


def test_format_schema_and_json(client, idle):
    for seed in range(3):
        r = client.chat(model="smollm2", messages=[{"role": "user", "content": "Invent a person."}],
                        format=PERSON, options={"seed": seed, "num_predict": 60})
        jsonschema.validate(json.loads(r.message.content), PERSON)
    r = client.generate(model="smollm2", prompt="A colour as JSON.", format="json",
                        options={"temperature": 0, "num_predict": 40})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)


def _check(calls):
    assert calls
    for call in calls:
        assert call.function.name in SCHEMAS
        jsonschema.validate(dict(call.function.arguments), SCHEMAS[call.function.name])


# one earlier exchange with a call: SmolLM2 rarely starts an answer with a call unless shown one
EARLIER_CALL = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}}]},
    {"role": "tool", "content": "21 degrees", "tool_name": "get_weather"},
    {"role": "assistant", "content": "It is 21 degrees in Rome."},
    *ASK,
]


def test_tool_calls_validate_streamed_or_not(client, idle):
    # Ollama has no tool_choice, so the model may answer in text: among 8 seeds at least one call,
    # every call valid, and a streamed answer's calls the same as the whole answer's
    options = {"num_predict": 300}
    answers = [client.chat(model="smollm2", messages=EARLIER_CALL, tools=TOOLS[:1],
                           options={**options, "seed": s})
               for s in range(8)]
    with_calls = [s for s, r in enumerate(answers) if r.message.tool_calls]
    assert with_calls, [r.message.content for r in answers]
    for r in answers:
        if r.message.tool_calls:
            _check(r.message.tool_calls)
        else:
            assert not r.message.content.startswith("<")
    seed = with_calls[0]
    parts = list(client.chat(model="smollm2", messages=EARLIER_CALL, tools=TOOLS[:1], stream=True,
                             options={**options, "seed": seed}))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    whole = answers[seed].message.tool_calls
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(c.function.name, dict(c.function.arguments)) for c in whole]


def test_a_tool_result_is_answered(client, idle):
    messages = [*ASK,
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}]
    r = client.chat(model="smollm2", messages=messages, options={"temperature": 0, "num_predict": 20})
    assert r.message.content and r.prompt_eval_count > 40


def test_bad_format_is_a_400(client, idle):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2", messages=ASK, format={"type": "nonsense"})
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2",
                    messages=[{"role": "user", "content": "What is this?", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "images" in str(e.value)


def test_tools_with_a_format_answer_a_call_or_the_schema(client, idle):
    for seed in range(4):
        r = client.chat(model="smollm2", messages=ASK, format=PERSON, tools=TOOLS,
                        options={"seed": seed, "temperature": 1.0, "num_predict": 80})
        if r.message.tool_calls:
            for call in r.message.tool_calls:
                jsonschema.validate(call.function.arguments, SCHEMAS[call.function.name])
        else:
            jsonschema.validate(json.loads(r.message.content), PERSON)


def test_the_fields_litellm_and_llama_index_send(idle):
    # litellm's ollama_chat/ echoes tool-call ids and types and names the call a tool message answers,
    # with truncate and shift on top; llama-index sends /api/show's trained context as num_ctx
    call = {"id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    body = {"model": "smollm2", "stream": False, "truncate": True, "shift": True, "keep_alive": "5m",
            "messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": "18 degrees", "tool_call_id": "call_7"}],
            "tools": TOOLS, "options": {"num_ctx": 32768, "num_predict": 8, "temperature": 0}}
    headers = {"Authorization": f"Bearer {idle.api_key}"}
    r = httpx.post(f"{idle.url}/api/chat", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert int(r.headers["X-KVServe-Num-Ctx"]) < 32768
    assert r.json()["done"] and r.json()["prompt_eval_count"] > 40
    streamed = httpx.post(f"{idle.url}/api/chat", json={**body, "stream": True}, headers=headers, timeout=120)
    assert streamed.status_code == 200 and "X-KVServe-Num-Ctx" in streamed.headers
