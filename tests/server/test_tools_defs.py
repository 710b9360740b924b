"""Tools whose parameters are pydantic models holding nested models and lists of them (``$defs`` and
``$ref``), through the official OpenAI, Anthropic and Ollama clients: every call validates against the
tool's own schema, references resolved (the ollama client mangles such schemas on its side: see its test)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Trip(BaseModel):
    cities: list[City] = Field(min_length=1, max_length=3)
    start: City
    days: int = Field(ge=1, le=14)


SCHEMA = Trip.model_json_schema()
ASK = "Plan a trip to Paris and Rome."
# Ollama has no tool_choice: the model chooses. After a call of its own in the history SmolLM2 calls again
EXAMPLE = {"cities": [{"name": "Paris", "country": "France"}],
           "start": {"name": "Paris", "country": "France"}, "days": 3}
HISTORY = [{"role": "user", "content": "Plan a trip to Paris."},
           {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "plan", "arguments": EXAMPLE}}]},
           {"role": "tool", "content": "planned", "tool_name": "plan"},
           {"role": "user", "content": "Now plan a trip to Rome."}]


def test_the_schema_has_references():
    assert "$defs" in SCHEMA and "$ref" in json.dumps(SCHEMA["properties"])


def test_openai(idle):
    client = openai.OpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    tools = [{"type": "function", "function": {"name": "plan", "parameters": SCHEMA}}]
    for stream in (False, True):
        kwargs = {"model": "smollm2", "messages": [{"role": "user", "content": ASK}], "tools": tools,
                      "tool_choice": "required", "temperature": 0, "max_tokens": 200}
        if stream:
            with client.chat.completions.stream(**kwargs) as s:
                r = s.get_final_completion()
        else:
            r = client.chat.completions.create(**kwargs)
        [call] = r.choices[0].message.tool_calls
        Trip.model_validate_json(call.function.arguments)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_anthropic(idle):
    client = anthropic.Anthropic(base_url=idle.url, api_key=idle.api_key, max_retries=0)
    message = client.messages.create(model="smollm2", max_tokens=200,
                                     messages=[{"role": "user", "content": ASK}],
                                     tools=[{"name": "plan", "input_schema": SCHEMA}],
                                     tool_choice={"type": "tool", "name": "plan"})
    [use] = [b for b in message.content if b.type == "tool_use"]
    Trip.model_validate(use.input)


def test_ollama(idle):
    client = ollama.Client(host=idle.url, headers=idle.headers)
    tools = [{"type": "function",
              "function": {"name": "plan", "description": "Plan a trip", "parameters": SCHEMA}}]
    messages = HISTORY  # every call must validate
    calls = []
    for seed in range(4):
        r = client.chat(model="smollm2", messages=messages, tools=tools,
                        options={"seed": seed, "temperature": 1.0, "num_predict": 160})
        calls += r.message.tool_calls or []
    assert calls
    for call in calls:
        # the ollama client's Tool model renames $defs to "defs" and drops a property's lone $ref ("start"
        # arrives as {}): the cities list, whose items still refer to City, must hold Cities
        arguments = call.function.arguments
        assert set(arguments) <= {"cities", "start", "days"} and isinstance(arguments["days"], int)
        for city in arguments["cities"]:
            City.model_validate(city)


def test_ollama_api_with_the_schema_whole(idle):
    # the same exchange sent as JSON (as litellm and LangChain's ChatOllama send it): the whole schema holds
    import httpx

    tools = [{"type": "function",
              "function": {"name": "plan", "description": "Plan a trip", "parameters": SCHEMA}}]
    messages = HISTORY
    calls = []
    for seed in range(4):
        r = httpx.post(f"{idle.url}/api/chat", headers=idle.headers, timeout=120, json={
            "model": "smollm2", "messages": messages, "tools": tools, "stream": False,
            "options": {"seed": seed, "temperature": 1.0, "num_predict": 160}})
        calls += r.json()["message"].get("tool_calls") or []
    assert calls
    for call in calls:
        Trip.model_validate(call["function"]["arguments"])
