"""Tool calls out of the output and into the grammar: complete calls survive a loop or a cut-off, text
around them is kept, and tool schemas are closed and keep their ``$defs`` inside the call's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.engine.constraints import Constraint
from kvserve.server.tools import parse_calls
from kvserve.server.tools.definitions import Tool, ToolChoice, call_schema, render_call
from kvserve.server.tools.grammar import call_constraint

CALL = render_call  # the form the grammar writes


def _call(name, **arguments):
    from kvserve.server.tools import ToolCall

    return CALL(ToolCall(name, arguments))


def test_repeated_calls_are_one_and_a_cut_off_call_is_dropped():
    text = "\n".join([_call("add", a=1, b=2), _call("add", a=1, b=2), _call("add", a=3, b=4),
                      "<tool_call>\n{\"na"])
    content, calls = parse_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert content == ""


def test_text_before_and_after_calls_is_kept():
    text = "Let me look.\n" + _call("get_weather", city="Paris") + "\nDone."
    content, calls = parse_calls(text)
    assert [c.name for c in calls] == ["get_weather"]
    assert content == "Let me look.\nDone."


def test_a_lone_cut_off_call_stays_text():
    text = "<tool_call>\n{\"name\": \"add\", \"argu"
    assert parse_calls(text) == (text, [])
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert parse_calls(broken) == (broken, [])


def test_tool_schemas_are_closed_unless_they_say_otherwise():
    loose = Tool("f",
                 parameters={"type": "object", "properties": {"x": {"type": "object", "properties": {}}}})
    arguments = call_schema(loose)["properties"]["arguments"]
    assert arguments["additionalProperties"] is False
    assert arguments["properties"]["x"]["additionalProperties"] is False
    jsonschema.validate({"x": {}}, arguments)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": {}, "y": 1}, arguments)
    open_ = Tool("g", parameters={"type": "object", "additionalProperties": {"type": "integer"}})
    assert call_schema(open_)["properties"]["arguments"]["additionalProperties"] == {"type": "integer"}


def test_defs_and_recursion_resolve_inside_the_call():
    # a pydantic model with a nested model, and a schema that refers to its own root
    nested = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                                 "required": ["name"]}},
              "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array",
                                                                           "items": {"$ref": "#"}}}}
    for params, good, bad in [
        (nested, {"city": {"name": "Paris"}}, {"city": {"name": 3}}),
        (tree, {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": "x"}]}),
    ]:
        schema = call_schema(Tool("f", parameters=params))
        schema.pop("x-guidance")
        jsonschema.validate({"name": "f", "arguments": good}, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "f", "arguments": bad}, schema)
        Constraint("lark",
                   call_constraint([Tool("f", parameters=params)], ToolChoice("required")).spec).grammar()


def test_tools_with_an_answer_format_is_one_grammar():
    answer = Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                     "required": ["n"]})
    tools = [Tool("f"), Tool("g")]
    auto = call_constraint(tools, ToolChoice(), answer)
    assert auto.kind == "lark" and "answer" in auto.spec and "TEXT" not in auto.spec
    auto.grammar()  # compiles
    assert "answer" not in call_constraint(tools, ToolChoice("required"), answer).spec
    assert call_constraint(tools, ToolChoice("none"), answer) is answer
    assert call_constraint([], ToolChoice(), answer) is answer


def test_one_call_unless_parallel_calls_are_asked_for():
    tools = [Tool("f")]
    assert "calls: call\n" in call_constraint(tools, ToolChoice("required")).spec + "\n"
    assert "{0,7}" in call_constraint(tools, ToolChoice("required", parallel=True)).spec
    assert "{0," not in call_constraint(tools, ToolChoice("required", "f", parallel=True)).spec
    json.loads(json.dumps(call_schema(tools[0])))
