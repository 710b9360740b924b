"""Tool calling, shared by the OpenAI, Ollama and Anthropic APIs: tools into the prompt, calls out of
the output, and the grammar that keeps calls well formed.

A call is written as Hermes-style models (Qwen 2.5, Hermes, SmolLM3) write it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Templates that take ``tools`` get them; for the others (SmolLM2's, Gemma 3's) the tools are described in
the system message, earlier calls are written back in this form and tool results as
``<tool_response>`` user turns. Whatever the template, the output is constrained: with ``required`` or
a named tool it is one call (or several, when parallel calls are allowed) whose arguments follow the
tool's JSON schema; with ``auto`` it is either text or calls, and a call still follows its schema.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvserve.engine.constraints import JSON_LAYOUT, Constraint
from kvserve.server.call_formats import HERMES, CallFormat
from kvserve.server.tool_types import (
    CALL_CLOSE,
    CALL_OPEN,
    MAX_PARALLEL_CALLS,
    Tool,
    ToolCall,
    ToolChoice,
    render_call,
)


def call_constraint(
    tools: list[Tool], choice: ToolChoice, answer: Constraint | None = None, fmt: CallFormat | None = None
) -> Constraint | None:
    """The grammar of the answer: None when the model may write anything (no tools, ``none``).
    ``answer``: the format of an answer that is not calls (a structured output alongside tools): with
    ``auto`` the answer is then calls or that JSON, never free text. ``fmt``: how the model family writes
    a call (``call_formats``; Hermes by default)."""
    if not tools or choice.mode == "none":
        return answer
    fmt = fmt or HERMES
    offered = [t for t in tools if choice.name is None or t.name == choice.name]
    max_calls = MAX_PARALLEL_CALLS if choice.parallel and choice.name is None else 1
    auto = choice.mode == "auto" and choice.name is None
    grammar = fmt.rules(offered, max_calls, bare=auto)
    if auto:
        if answer is not None:
            grammar.insert(0, "start: calls | answer")
            grammar.append(f"answer: %json {json.dumps(_answer_schema(answer))}")
        else:  # text that does not start a call; a call can only come first
            grammar.insert(0, "start: TEXT | calls")
            grammar.append(f"TEXT: {fmt.text_regex}")
    else:
        grammar.insert(0, "start: calls")
    return Constraint("lark", "\n".join(grammar))


def _answer_schema(answer: Constraint) -> dict[str, Any]:
    if answer.kind == "json_object":
        schema: Any = {"type": "object"}
    elif answer.kind == "json_schema":
        schema = json.loads(answer.spec)
        schema = schema if isinstance(schema, dict) else {}
    else:
        raise ValueError(f"a {answer.kind} answer format does not go with tools")
    return {**schema, "x-guidance": JSON_LAYOUT}


class WrittenCalls:
    """The answers whose calls a client may send back, as the model wrote them (the last ``capacity``).

    An agent's next request holds the call it got (and its result); rendered by the chat template, the call
    is the family's canonical form, which differs from what the model wrote when it wrote a bare call, put
    other spaces in its JSON or cut it into other tokens. The answer's own text rendered in its place makes
    the next prompt begin with the very tokens the cache holds from this answer, so only the result and what
    follows are computed. Only an echo whose calls and text are the ones parsed from that answer is
    replaced."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[str, str, list[ToolCall]]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(call_id: str) -> str:
        """A call's id without the prefix each API gives it (``call_``, ``toolu_``, ``fc_``)."""
        prefix, _, rest = call_id.partition("_")
        return rest if prefix in ("call", "toolu", "fc") and rest else call_id

    def remember(self, written: str, text: str, calls: list[ToolCall]) -> None:
        with self._lock:
            for call in calls:
                self._items[self.key(call.id)] = (written, text, calls)
                self._items.move_to_end(self.key(call.id))
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def written(self, message: dict[str, Any]) -> str | None:
        """The text the model wrote for an assistant turn of calls, when the turn echoes that answer whole."""
        echoed = message.get("tool_calls") or []
        with self._lock:
            found = self._items.get(self.key(echoed[0].id)) if echoed else None
        if found is None:
            return None
        written, text, calls = found
        same_calls = [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in echoed]
        return written if same_calls and (message.get("content") or "").strip() == text.strip() else None


@dataclass(frozen=True, slots=True)
class Calls:
    """What an answer's calls are read against: the model family's format and the tools offered; ``written``
    keeps each answer that held calls (``WrittenCalls``)."""

    fmt: CallFormat
    tools: list[Tool]
    written: WrittenCalls | None = None


def parse_calls(text: str, calls: Calls | None = None) -> tuple[str, list[ToolCall]]:
    """(the text that is not calls, the calls) as the model family writes them (Hermes by default). Call it
    on an answer's final text: an answer with calls is remembered (``Calls.written``)."""
    if calls is None:
        return HERMES.parse(text)
    rest, found = calls.fmt.parse(text, calls.tools)
    if found and calls.written is not None and calls.fmt.text_holds_calls:
        calls.written.remember(text, rest, found)
    return rest, found


def text_to_stream(holding: bool, out, calls: Calls | None = None) -> tuple[bool, str]:
    """(still holding, text to send now) for one output of a streamed answer that may be calls: the
    answer is held while it is empty or may still become a call (a call can only come first, see
    ``call_constraint``); once it is text, what was held goes out, then each delta as it comes."""
    if not holding:
        return False, out.delta_text
    if out.text and not (calls.fmt if calls is not None else HERMES).may_start(out.text):
        return False, out.text
    return True, ""


def tools_prompt(tools: list[Tool]) -> str:
    listed = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                   ensure_ascii=False)
        for t in tools
    )
    return (
        "You can call these tools:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a tool, answer with one line per call, each as\n"
        f'{CALL_OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{CALL_CLOSE}\n'
        "and nothing else; the results come back in <tool_response> blocks."
    )


def messages_for_template(
    messages: list[dict[str, Any]], tools: list[Tool], template_takes_tools: bool,
    written: WrittenCalls | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables). Messages here are {"role", "content", optional
    "tool_calls": [ToolCall], optional "tool_call_id"}; tool turns become what the template reads; an
    assistant turn of calls this server answered is the text the model wrote (``WrittenCalls``)."""
    if written is not None:
        messages = [_as_written(m, written) for m in messages]
    if template_takes_tools:
        return _for_tools_template(messages, tools)
    return _with_tools_prompt(_tool_turns_as_text(messages), tools), {}


def _for_tools_template(messages: list[dict[str, Any]],
                        tools: list[Tool]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """For a template that renders tools itself: the calls and the tools in the OpenAI shape it reads."""
    rendered = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}}
                     for c in m["tool_calls"]]
            rendered.append({**m, "tool_calls": calls})
        else:
            rendered.append(m)
    spec = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]
    return rendered, ({"tools": spec} if tools else {})


def _tool_turns_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that knows no tools: calls written into the assistant's text as Hermes writes them,
    results as user turns in <tool_response> blocks, the results of parallel calls as one turn."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if m.get("tool_calls"):
            content = "\n".join([content, *(render_call(c) for c in m["tool_calls"])]).strip("\n")
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if m["role"] == "tool" and out and out[-1].get("tool_response"):
            # parallel results: one turn
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + content}
            continue
        out.append({"role": role, "content": content, "tool_response": m["role"] == "tool"})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _with_tools_prompt(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools, listed for a template that knows none, in the system turn (one made first if none is)."""
    if not tools:
        return messages
    prompt = tools_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _as_written(message: dict[str, Any], written: WrittenCalls) -> dict[str, Any]:
    if message["role"] != "assistant" or not message.get("tool_calls"):
        return message
    text = written.written(message)
    return message if text is None else {"role": "assistant", "content": text}


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template
