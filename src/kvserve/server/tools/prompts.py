"""Tools and tool turns into the prompt: a template that takes ``tools`` gets them in OpenAI's shape; for
the others (SmolLM2's, Gemma 3's) the tools are described in the system turn, earlier calls written back
as Hermes writes them and tool results as ``<tool_response>`` user turns. An assistant turn of calls this
server answered goes back as the text the model wrote (``calls.WrittenCalls``)."""

from __future__ import annotations

import json
from typing import Any

from kvserve.server.tools.calls import WrittenCalls
from kvserve.server.tools.definitions import CALL_CLOSE, CALL_OPEN, Tool, render_call


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
