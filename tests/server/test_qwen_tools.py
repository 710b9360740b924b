"""Tool calls on Qwen2.5-Coder-0.5B, the family local agents run, on the OpenAI chat, Responses, Anthropic and
Ollama APIs, forced and auto, streamed and not.

Qwen's ``<tool_call>`` is one token of its vocabulary (151657): the grammar names it by id, so a forced call
is the token the model writes (not a 400 for a grammar the vocabulary cannot follow), and under ``auto`` the
model may start one. Every answer here must be a call of the offered tool whose arguments follow its schema.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import ollama
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"]}
ASK = "What is the weather in Paris?"
FORCED, AUTO = "forced", "auto"


def _check(name: str, arguments: dict | str) -> None:
    assert name == "get_weather"
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(arguments, WEATHER)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", [FORCED, AUTO])
def test_openai_chat(coder, mode, stream):
    client = OpenAI(base_url=f"{coder.url}/v1", api_key=coder.api_key, max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER}}]
    kw = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "tools": tools, "temperature": 0,
          "max_tokens": 64, "tool_choice": "required" if mode == FORCED else "auto"}
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    else:
        calls, reasons = [], []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
                reasons.append(choice.finish_reason)
        assert "tool_calls" in reasons
    assert len(calls) == 1
    _check(*calls[0])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", [FORCED, AUTO])
def test_responses(coder, mode, stream):
    client = OpenAI(base_url=f"{coder.url}/v1", api_key=coder.api_key, max_retries=0, timeout=300)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
              "parameters": WEATHER}]
    kw = {"model": MODEL, "input": ASK, "tools": tools, "temperature": 0, "max_output_tokens": 64,
          "tool_choice": "required" if mode == FORCED else "auto"}
    if not stream:
        output = client.responses.create(**kw).output
    else:
        with client.responses.stream(**kw) as events:
            output = events.get_final_response().output
    calls = [item for item in output if item.type == "function_call"]
    assert len(calls) == 1
    _check(calls[0].name, calls[0].arguments)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", [FORCED, AUTO])
def test_anthropic(coder, mode, stream):
    client = anthropic.Anthropic(base_url=coder.url, api_key=coder.api_key, max_retries=0, timeout=300)
    kw = {"model": MODEL, "max_tokens": 64, "extra_body": {"temperature": 0},
          "messages": [{"role": "user", "content": ASK}],
          "tools": [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}],
          "tool_choice": {"type": "any" if mode == FORCED else "auto"}}
    if not stream:
        message = client.messages.create(**kw)
    else:
        with client.messages.stream(**kw) as events:
            message = events.get_final_message()
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1
    _check(uses[0].name, uses[0].input)


@pytest.mark.parametrize("stream", [False, True])
def test_ollama(coder, stream):
    """Ollama has no tool_choice: the model chooses (auto)."""
    client = ollama.Client(host=coder.url, headers=coder.headers, timeout=300)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "options": {"temperature": 0},
          "tools": [{"type": "function",
                     "function": {"name": "get_weather", "description": "Weather in a city",
                                                      "parameters": WEATHER}}]}
    if not stream:
        calls = client.chat(**kw).message.tool_calls
    else:
        calls = [c for part in client.chat(stream=True, **kw) for c in part.message.tool_calls or []]
    assert calls and len(calls) == 1
    _check(calls[0].function.name, calls[0].function.arguments)


def test_a_forced_call_is_written_with_the_marker_token(coder):
    """The answer's first token is the marker itself (151657), not its bytes spelled out in pieces."""
    client = OpenAI(base_url=f"{coder.url}/v1", api_key=coder.api_key, max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=tools,
                                       tool_choice="required", temperature=0, max_tokens=64, logprobs=True)
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[0] == "<tool_call>" and tokens[-1] == "</tool_call>", tokens


BLOCK = 16  # the server's KV block


@pytest.mark.parametrize("ask",
                         [ASK, ('Respond with exactly this tool call: {"name": "get_weather", "arguments": '
                                       '{"city": "Paris"}}')])
def test_a_round_trip_computes_only_what_the_client_added(coder, ask):
    """The call sent back renders as the tokens the model wrote (marked or bare): the next request reads the
    cache up to the tool's result, the prompt's last partial block aside."""
    client = OpenAI(base_url=f"{coder.url}/v1", api_key=coder.api_key, max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [{"role": "system", "content": f"You are a weather agent ({len(ask)}). " * 20},
                {"role": "user", "content": ask}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0,
                                           max_tokens=64)
    [call] = first.choices[0].message.tool_calls
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0,
                                            max_tokens=8)
    added = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    computed = second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    assert computed <= added + BLOCK, (computed, added)
