"""OpenAI's Responses API through the official client: text, streamed events the client reassembles,
function tools (forced, with a result sent back by ``previous_response_id`` or in full), a structured
answer, stored responses, and the OpenAI Agents SDK's default model class running an agent with a tool."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.server.tool_cases import WEATHER

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_text_streamed_or_not_is_the_same(client, idle):
    whole = client.responses.create(model="smollm2", input="What is the capital of France?",
                                    instructions="Answer in one sentence.", temperature=0,
                                    max_output_tokens=24)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 10 and whole.usage.output_tokens <= 24
    with client.responses.stream(model="smollm2", input="What is the capital of France?",
                                 instructions="Answer in one sentence.", temperature=0,
                                 max_output_tokens=24) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds


def test_a_forced_function_call_and_its_result(client, idle):
    for stream in (False, True):
        kwargs = {"model": "smollm2", "input": ASK, "tools": [TOOL], "tool_choice": "required",
                  "temperature": 0,
                      "max_output_tokens": 120}
        if stream:
            with client.responses.stream(**kwargs) as s:
                r = s.get_final_response()
        else:
            r = client.responses.create(**kwargs)
        [call] = [item for item in r.output if item.type == "function_call"]
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    follow = client.responses.create(model="smollm2", previous_response_id=r.id, input=[result], tools=[TOOL],
                                     tool_choice="none", temperature=0, max_output_tokens=24)
    alone = client.responses.create(model="smollm2", input=ASK, tools=[TOOL], tool_choice="none",
                                    max_output_tokens=1)
    # the call, its result
    assert follow.output_text and follow.usage.input_tokens > alone.usage.input_tokens + 20
    # the same turn sent in full gives the same prompt
    full = client.responses.create(
        model="smollm2", tools=[TOOL], tool_choice="none", temperature=0, max_output_tokens=24,
        input=[{"role": "user", "content": ASK}, {"type": "function_call", "call_id": call.call_id,
                                                  "name": call.name, "arguments": call.arguments}, result])
    assert full.usage.input_tokens == follow.usage.input_tokens and full.output_text == follow.output_text


def test_structured_output_alone_and_beside_tools(client, idle):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}}
    r = client.responses.create(model="smollm2", input="Invent a person.", text=fmt, temperature=0,
                                max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), person)
    r = client.responses.create(model="smollm2", input=ASK, text=fmt, tools=[TOOL], temperature=0,
                                max_output_tokens=80)
    calls = [item for item in r.output if item.type == "function_call"]
    if not calls:
        jsonschema.validate(json.loads(r.output_text), person)


def test_stored_responses(client, idle):
    r = client.responses.create(model="smollm2", input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", input="Hi", previous_response_id=r.id, max_output_tokens=4)
    unstored = client.responses.create(model="smollm2", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for bad in ([], [{"type": "input_image", "image_url": "x"}], [{"role": "robot", "content": "x"}]):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="smollm2", input=bad, max_output_tokens=4)


def test_the_agents_sdks_default_model_runs_an_agent_with_a_tool(idle):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.model_settings import ModelSettings

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    agent = Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="smollm2", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required"),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, ASK, max_turns=2))
    assert calls and result.final_output.startswith("18 degrees")
