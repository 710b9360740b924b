"""Agent use through the official ``openai`` client: tool calls whose arguments always validate,
JSON-schema answers, streamed calls the client reassembles, and a multi-turn exchange with a tool
result. SmolLM2-135M chooses poorly, but the grammar makes every call well formed."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.tool_cases import ADD, ASK, SCHEMAS, TOOLS

pytestmark = pytest.mark.slow


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
                                           parallel_tool_calls=False, temperature=1.0, seed=seed,
                                           max_tokens=80)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message)
        assert len(choice.message.tool_calls) == 1


def test_parallel_calls_end_within_the_grammars_limit(client, idle):
    # SmolLM2 repeats its call until something stops it: here the grammar's 8 calls (one tool, so that
    # they fit the test server's 512-token context); repeats of a call are one call
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS[:1], tool_choice="required",
                                       parallel_tool_calls=True, temperature=0, max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message)
    assert 1 <= len(choice.message.tool_calls) <= 8
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls)


def test_a_forced_call_with_the_clients_defaults_ends_as_one_call(client, idle):
    # instructor, pydantic-ai and LangChain force a tool and leave parallel_tool_calls out (OpenAI's
    # default is true): the answer must be the call, ended, well inside max_tokens
    for choice_ in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for stream in (False, True):
            kwargs = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": choice_,
                      "temperature": 0,
                          "max_tokens": 120}
            if stream:
                with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as s:
                    r = s.get_final_completion()
            else:
                r = client.chat.completions.create(**kwargs)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            _check_calls(choice.message)
            assert len(choice.message.tool_calls) == 1
            assert r.usage.completion_tokens < 120


def test_tools_with_a_structured_answer(client, idle):
    # the OpenAI Agents SDK's agent with tools and an output_type: a call or the schema's JSON
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
    kinds = set()
    for seed in range(6):
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, response_format=fmt,
                                           temperature=1.0, seed=seed, max_tokens=80)
        choice = r.choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message)
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(choice.message.content), person)
            kinds.add("answer")
    assert kinds
    forced = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, response_format=fmt,
                                            tool_choice="required", temperature=0, max_tokens=80)
    _check_calls(forced.choices[0].message)


def test_open_and_nested_tool_schemas(client, idle):
    # LangChain's @tool leaves additionalProperties out; a pydantic model with a nested model has $defs
    loose = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
             "required": ["city"]}
    nested = {"$defs": {"Place": {"type": "object",
                                  "properties": {"city": {"type": "string", "maxLength": 12}},
                                  "required": ["city"], "title": "Place"}},
              "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"]}
    for params in (loose, nested):
        tools = [{"type": "function", "function": {"name": "find", "parameters": params}}]
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=tools, tool_choice="required",
                                           temperature=0, max_tokens=80)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        arguments = json.loads(choice.message.tool_calls[0].function.arguments)
        closed = json.loads(json.dumps(params).replace('"required"',
                                                       '"additionalProperties": false, "required"'))
        jsonschema.validate(arguments, closed)


def test_logit_bias_bans_and_forces_tokens(client, idle):
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0,
           "max_tokens": 3,
               "logprobs": True}
    first = client.chat.completions.create(**ask).choices[0].logprobs.content[0].token
    top = client.chat.completions.create(**ask, top_logprobs=5).choices[0].logprobs.content[0].top_logprobs
    assert top[0].token == first
    headers = {"Authorization": f"Bearer {idle.api_key}"}
    tokenized = httpx.post(f"{idle.url}/tokenize", json={"content": first}, headers=headers).json()
    [banned] = tokenized["tokens"]
    other = client.chat.completions.create(**ask, logit_bias={str(banned): -100}).choices[0]
    assert other.logprobs.content[0].token != first
    forced = client.chat.completions.create(**ask, logit_bias={"28": 100}).choices[0]
    piece = httpx.post(f"{idle.url}/detokenize", json={"tokens": [28]}, headers=headers).json()["content"]
    assert [t.token for t in forced.logprobs.content] == [piece] * 3
    for bad in ({"x": 1}, {"28": 101}, {"999999999": 1}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**ask, logit_bias=bad)


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
                                           parallel_tool_calls=False, temperature=0,
                                           max_tokens=80).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]


def test_auto_answers_either_text_or_valid_calls(client, idle):
    for seed in range(4):
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=1.0,
                                           seed=seed, max_tokens=60)
        choice = r.choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message)
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.message.content and not choice.message.content.startswith("<")


def test_a_tool_result_turn_is_answered(client, idle):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert r.usage.prompt_tokens > 40  # the call and its result are in the prompt


def test_bad_tool_requests_are_400s(client, idle):
    bad = [
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [TOOLS[0], TOOLS[0]]},
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        {"tool_choice": "required"},
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **kwargs)
