"""Agent use through the official ``openai`` client: tool calls whose arguments always validate,
JSON-schema answers, streamed calls the client reassembles, and a multi-turn exchange with a tool
result. SmolLM2-135M chooses poorly, but the grammar makes every call well formed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                   "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def _check_calls(message, allowed=SCHEMAS):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_required_tool_call_arguments_validate(client, idle):
    for seed in range(3):
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=80)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message)
        assert len(choice.message.tool_calls) == 1


def test_parallel_calls_end_within_the_grammars_limit(client, idle):
    # SmolLM2 repeats its call until something stops it: here the grammar's 8 calls (one tool, so that
    # they fit the test server's 512-token context)
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS[:1], tool_choice="required",
                                       temperature=0, max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message)
    assert 1 <= len(choice.message.tool_calls) <= 8


def test_a_named_tool_is_the_one_called_once(client, idle):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       temperature=0, max_tokens=60)
    message = r.choices[0].message
    _check_calls(message, {"add": ADD})
    assert len(message.tool_calls) == 1


def test_json_schema_answers_validate_for_20_seeds(client, idle):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for batch in range(4):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt,
            temperature=1.0, seed=100 * batch, n=5, max_tokens=60)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_streamed_tool_call_is_reassembled_by_the_client(client, idle):
    with client.chat.completions.stream(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_tokens=80) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message)
    whole = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]


def test_auto_answers_either_text_or_valid_calls(client, idle):
    for seed in range(4):
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=60)
        choice = r.choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message)
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.message.content and not choice.message.content.startswith("<")


def test_a_tool_result_turn_is_answered(client, idle):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert r.usage.prompt_tokens > 40  # the call and its result are in the prompt


def test_bad_tool_requests_are_400s(client, idle):
    bad = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tools=[TOOLS[0], TOOLS[0]]),
        dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        dict(tool_choice="required"),
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **kwargs)
