"""How each model family writes a tool call, chosen from its chat template: the grammar that keeps calls
in that form, and the parser that reads them back.

    Hermes (Qwen2.5, Hermes, SmolLM3; the default)   <tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call> Qwen3-Coder                                      
    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
                                                      </function>\\n</tool_call>
    Llama 3.x (JSON tool calling)                     {"name": ..., "parameters": {...}}
    Mistral                                           [TOOL_CALLS][{"name": ..., "arguments": {...}}]

Each format gives the Lark rules of ``calls`` (one call, or up to ``max_calls``), the text that cannot start
a call (``text_regex``: a call comes first), whether a streamed answer may still become calls
(``may_start``), and ``parse``. llama.cpp's chat parsers and vLLM's tool parsers read the same forms.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.engine.constraints import JSON_LAYOUT
from kvserve.server.tools.definitions import (
    CALL_CLOSE,
    CALL_OPEN,
    Tool,
    ToolCall,
    call_schema,
    closed_parameters,
)

ONE_LINE = JSON_LAYOUT


def _dedupe(calls: list[ToolCall]) -> list[ToolCall]:
    """A repeat of an earlier call dropped (small models loop on a call)."""
    seen, out = set(), []
    for call in calls:
        key = json.dumps([call.name, call.arguments], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(call)
    return out


def _gathered(schemas: list[dict], path) -> tuple[list[dict], dict]:
    """Call schemas moved under ``path(i)`` of one wrapping schema: their root references re-rooted there,
    their ``$defs`` gathered for the wrapper's root (each %json is one schema document)."""
    defs: dict[str, dict] = {}
    moved = []
    for i, schema in enumerate(schemas):
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        for key in ("$defs", "definitions"):
            if isinstance(schema.get(key), dict):
                defs.setdefault(key, {}).update(schema.pop(key))
        moved.append(json.loads(json.dumps(schema).replace('"#/properties/', f'"{path(i)}/properties/')))
    return moved, defs


def _joined(parts: list[str], rest: str) -> str:
    return "\n".join(p.strip("\n") for p in [*parts, rest] if p.strip())


def _json_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return ToolCall(value["name"], arguments if isinstance(arguments, dict) else {})


class CallFormat:
    """Hermes: ``<tool_call>`` blocks of JSON. ``marks``: the open and close markers as grammar terms, token
    ids (``<[151657]>``) where the vocabulary has each marker as one token, which is what the model writes and
    what the grammar engine must be told (it never matches a marker token against the marker's bytes)."""

    name = "hermes"
    # the answer's decoded text holds its calls whole, markers included: rendered back as the assistant's turn
    # it reads as the tokens the model wrote (``tools.WrittenCalls``); not so where a marker is a special
    # token that decoding drops (Mistral) or a template adds its own around the call (Llama 3's python tag)
    text_holds_calls = True
    # an answer that is text: it cannot start a call (nor with blank space, which a model that means to call
    # writes first, nor with "{", a bare call's start), nor hold one further on (a call there would escape the
    # grammar, read back unchecked)
    text_regex = r"/[^<\s{](.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/ & ~/```json(.|\n)*/"

    def __init__(self, marks: tuple[str, str] | None = None) -> None:
        self.open_mark, self.close_mark = marks or (json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE))

    def rules(self, offered: list[Tool], max_calls: int, bare: bool = False) -> list[str]:
        """``bare``: a call may also be written as the bare JSON object, no markers, alone or in a json code
        block (Qwen2.5-Coder's habits, as llama.cpp's Hermes parser reads the first), checked against the
        tools' schemas like a marked one; an answer that is text then starts with neither."""
        calls = "call" if max_calls == 1 else f"call (NL call){{0,{max_calls - 1}}}"
        tools = " | ".join(f"tool{i}" for i in range(len(offered)))
        return [
            f"calls: {calls}" + (" | bare" if bare else ""),
            f"call: {self.open_mark} NL ({tools}) NL {self.close_mark}",
            *(f"tool{i}: %json {json.dumps(call_schema(t))}" for i, t in enumerate(offered)),
            *([f'bare: ({tools}) | "```json" NL ({tools}) NL "```"'] if bare else []),
            r'NL: "\n"',
        ]

    def may_start(self, text: str) -> bool:
        return text.startswith((CALL_OPEN, "{", "```json")) or any(
            m.startswith(text) for m in (CALL_OPEN, "```json"))

    def parse(self, text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
        """(the text that is not calls, the calls): every complete ``<tool_call>`` block whose body is a
        call, in order, a repeat dropped; a block cut off by the token limit is dropped where complete
        calls precede it; or, with no block, an answer that is one bare call of an offered tool (as JSON, or
        in a json code block: Qwen2.5-Coder writes both). Text that only looks like a call stays text."""
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        while (start := text.find(CALL_OPEN, pos)) >= 0:
            end = text.find(CALL_CLOSE, start)
            if end < 0:
                if calls:
                    # the call cut off after complete ones is dropped
                    return _joined(kept, ""), _dedupe(calls)
                break
            call = _json_call(text[start + len(CALL_OPEN) : end])
            kept.append(text[pos : end + len(CALL_CLOSE)] if call is None else text[pos:start])
            calls += [call] if call is not None else []
            pos = end + len(CALL_CLOSE)
        if not calls:
            body = text.strip().removeprefix("```json").removesuffix("```")
            bare = _json_call(body) if tools and body.lstrip().startswith("{") else None
            if bare is not None and bare.name in {t.name for t in tools}:
                return "", [bare]
            return text, []
        return _joined(kept, text[pos:]), _dedupe(calls)


class Qwen3CoderFormat(CallFormat):
    """Qwen3-Coder's XML: a parameter's value as text (a string) or JSON (anything else)."""

    name = "qwen3-coder"
    CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    text_regex = r"/[^<\s](.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/"

    def rules(self, offered: list[Tool], max_calls: int, bare: bool = False) -> list[str]:
        calls = "call" if max_calls == 1 else f"call (NL call){{0,{max_calls - 1}}}"
        tools = " | ".join(f"tool{i}" for i in range(len(offered)))
        rules = [f"calls: {calls}", f'call: {self.open_mark} NL ({tools}) "</function>" NL {self.close_mark}',
                 r'NL: "\n"']
        for i, tool in enumerate(offered):
            schema = closed_parameters(tool)
            required = set(schema.get("required", []))
            parts = []
            for k, (pname, pschema) in enumerate((schema.get("properties") or {}).items()):
                value = f"value{i}_{k}"
                rules.append(f"{value}: {self._value(pschema, schema)}")
                part = f'"<parameter={pname}>" NL {value} NL "</parameter>" NL'
                parts.append(part if pname in required else f"({part})?")
            rules.append(f'tool{i}: "<function={tool.name}>" NL {" ".join(parts)}'.rstrip())
        return rules

    @staticmethod
    def _value(pschema: Any, root: dict) -> str:
        if isinstance(pschema, dict) and pschema.get("type") == "string" and "enum" not in pschema:
            most = pschema.get("maxLength")
            count = "*" if most is None else f"{{{int(pschema.get('minLength', 0))},{int(most)}}}"
            return rf"/([^<\n]|<[^\/\n]){count}/"  # text up to the closing tag
        sub = dict(pschema) if isinstance(pschema, dict) else {}
        defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        return f"%json {json.dumps({**sub, **defs, 'x-guidance': ONE_LINE})}"

    def parse(self, text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
        schemas = {t.name: closed_parameters(t) for t in tools or []}
        calls, kept, pos = [], [], 0
        for m in self.CALL.finditer(text):
            name = m.group(1).strip()
            properties = (schemas.get(name) or {}).get("properties") or {}
            arguments = {}
            for p in self.PARAM.finditer(m.group(2)):
                key, raw = p.group(1).strip(), p.group(2)
                if (properties.get(key) or {}).get("type") == "string":
                    arguments[key] = raw
                else:
                    try:
                        arguments[key] = json.loads(raw)
                    except json.JSONDecodeError:
                        arguments[key] = raw
            calls.append(ToolCall(name, arguments))
            kept.append(text[pos : m.start()])
            pos = m.end()
        if not calls:
            return text, []
        rest = text[pos:]
        if CALL_OPEN in rest:  # a call cut off after complete ones
            rest = rest[: rest.index(CALL_OPEN)]
        return _joined(kept, rest), _dedupe(calls)


class Llama3JsonFormat(CallFormat):
    """Llama 3.1-3.3's JSON tool calling: the answer is one JSON object naming the function."""

    name = "llama3-json"
    text_holds_calls = False
    text_regex = r"/[^{](.|\n)*/"

    def rules(self, offered: list[Tool], max_calls: int, bare: bool = False) -> list[str]:
        one = len(offered) == 1
        items, defs = _gathered([self._schema(t) for t in offered], lambda i: "#" if one else f"#/anyOf/{i}")
        schema = items[0] if one else {"anyOf": items}
        return [f"calls: %json {json.dumps({**schema, **defs, 'x-guidance': ONE_LINE})}"]

    @staticmethod
    def _schema(tool: Tool) -> dict:
        call = call_schema(tool)
        call["properties"]["parameters"] = call["properties"].pop("arguments")
        call["required"] = ["name", "parameters"]
        return json.loads(json.dumps(call).replace('"#/properties/arguments', '"#/properties/parameters'))

    def may_start(self, text: str) -> bool:
        return text.lstrip().startswith("{") or not text.strip()

    def parse(self, text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix("<|python_tag|>")
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return text, []
        arguments = value.get("parameters", value.get("arguments", {}))
        return "", [ToolCall(value["name"], arguments if isinstance(arguments, dict) else {})]


class MistralFormat(CallFormat):
    """Mistral's ``[TOOL_CALLS]`` followed by a JSON array of calls (the marker is a special token: the
    grammar writes it by id, and the answer's text, special tokens left out, starts at the array)."""

    name = "mistral"
    text_holds_calls = False
    MARK = "[TOOL_CALLS]"
    text_regex = r"/[^\[](.|\n)*/"

    def __init__(self, mark_id: int | None = None) -> None:
        super().__init__()
        self.mark_id = mark_id

    def rules(self, offered: list[Tool], max_calls: int, bare: bool = False) -> list[str]:
        one = len(offered) == 1
        items, defs = _gathered([call_schema(t) for t in offered],
                                lambda i: "#/items" if one else f"#/items/anyOf/{i}")
        array = {"type": "array", "items": items[0] if one else {"anyOf": items}, "minItems": 1,
                 "maxItems": max_calls, **defs, "x-guidance": ONE_LINE}
        mark = f"<[{self.mark_id}]>" if self.mark_id is not None else json.dumps(self.MARK)
        return [f"calls: {mark} %json {json.dumps(array)}"]

    def may_start(self, text: str) -> bool:
        return text.startswith(("[", self.MARK)) or self.MARK.startswith(text)

    def parse(self, text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.MARK).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, dict) and isinstance(v.get("name"), str)
                                                   for v in value) or not value:
            return text, []
        calls = [ToolCall(v["name"], v.get("arguments") if isinstance(v.get("arguments"), dict) else {})
                 for v in value]
        return "", _dedupe(calls)


HERMES = CallFormat()


def _marks(tokenizer) -> tuple[str, str] | None:
    """The call markers as grammar terms: by token id where each is one token of the vocabulary (Qwen's
    ``<tool_call>`` is 151657), else None (their bytes)."""
    ids = [tokenizer.backend.token_to_id(m) for m in (CALL_OPEN, CALL_CLOSE)]
    return None if None in ids else (f"<[{ids[0]}]>", f"<[{ids[1]}]>")


def call_format(tokenizer) -> CallFormat:
    """The family's format from the chat template (and the markers' tokens); Hermes otherwise."""
    template = (tokenizer.chat_template if tokenizer is not None else None) or ""
    marks = _marks(tokenizer) if tokenizer is not None else None
    if "<function=" in template and "<parameter=" in template:
        return Qwen3CoderFormat(marks)
    if MistralFormat.MARK in template:
        return MistralFormat(tokenizer.backend.token_to_id(MistralFormat.MARK))
    if "<|start_header_id|>" in template and '"parameters"' in template.replace("\\", ""):
        return Llama3JsonFormat()
    return CallFormat(marks) if marks is not None else HERMES
