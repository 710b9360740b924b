"""The tools and questions the tool-calling tests share across the APIs."""

from __future__ import annotations

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
    {"type": "function",
     "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]


SCHEMAS = {"get_weather": WEATHER, "add": ADD}


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
