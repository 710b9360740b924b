"""Claude Code, Codex CLI and Qwen Code, each with its default settings, run a short task against the server.

What is asserted is the protocol, not the model's skill: every request the agent sent was answered 2xx, the
server's tool call reached the agent as a call (the agent ran it and sent its result back in a later request,
which was answered too), and within a session each round trip after the first read only its new tokens from
the model (the rest came from the prefix cache). The prompt tells the small model which call to write, as
the JSON object Qwen2.5-Coder writes: the grammar then makes it a call of one of the agent's real tools.
"""

from __future__ import annotations

import json

from kvserve.benchmark.agent_task import call_prompt
from tests.agents.conftest import MODEL, Session, agent_binary

BLOCK = 16  # the server's KV block: a prompt's partial last block is computed again


def test_claude_code(run_agent):
    claude = agent_binary("claude")
    session = run_agent(
        [str(claude), "-p", call_prompt("Read", {"file_path": "{repo}/calc.py"}), "--model", MODEL],
        {"ANTHROPIC_BASE_URL": "{proxy}", "ANTHROPIC_API_KEY": "{key}",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"},
    )
    check(session, "/v1/messages", anthropic_round_trip, anthropic_usage)


def test_codex(run_agent):
    codex = agent_binary("codex")
    config = (
        f'model = "{MODEL}"\nmodel_provider = "kvserve"\n\n[model_providers.kvserve]\nname = "kvserve"\n'
              'base_url = "{proxy}/v1"\nwire_api = "responses"\nenv_key = "KVSERVE_API_KEY"\n')
    session = run_agent(
        [str(codex), "exec", "--skip-git-repo-check", call_prompt("exec_command", {"cmd": "cat calc.py"})],
        {"KVSERVE_API_KEY": "{key}"}, files={".codex/config.toml": config},
    )
    check(session, "/v1/responses", responses_round_trip, responses_usage)


def test_qwen_code(run_agent):
    qwen = agent_binary("qwen")
    session = run_agent(
        [str(qwen), "--auth-type", "openai", call_prompt("read_file", {"file_path": "{repo}/calc.py"})],
        {"OPENAI_BASE_URL": "{proxy}/v1", "OPENAI_API_KEY": "{key}", "OPENAI_MODEL": MODEL},
    )
    check(session, "/v1/chat/completions", chat_round_trip, chat_usage)


# --- what the recorded exchanges must show ------------------------------------------------------------------
def check(session: Session, path: str, round_trip, usage) -> None:
    assert not session.failures(), (
        f"requests answered 4xx/5xx: {session.failures()}\n{session.output[-2000:]}"
    )
    asked = [r for r in session.records if r["path"] == path and r["method"] == "POST"]
    assert asked, f"the agent sent no {path} request:\n{session.output[-2000:]}"
    assert any(round_trip(r["body"]) for r in asked), (
        f"no request sent a tool call's result back:\n{session.output[-2000:]}")
    assert session.returncode == 0, f"{session.output[-2000:]}\n{_summary(session.records)}"
    check_prefix_reuse(asked, usage)


def _summary(records: list[dict]) -> str:
    return "\n".join(f"{r['method']} {r['path']} {r['status']} {r['seconds']} s" for r in records)


def check_prefix_reuse(asked: list[dict], usage) -> None:
    """Requests of one conversation (the same first message) after the first: the tokens computed are at most
    those the client added since the last answer, plus one block."""
    last: dict[str, tuple[int, int]] = {}
    for record in asked:
        if not _finished(record["response"]):
            continue  # the agent closed the stream before its end (it had what it needed): no usage was sent
        prompt, cached, output = usage(record["response"])
        key = _conversation(record["body"])
        if key in last:
            before, before_output = last[key]
            added = prompt - before - before_output
            assert prompt - cached <= max(added, 0) + BLOCK, (
                f"a round trip computed {prompt - cached} prompt tokens, {added} of them new "
                f"({cached} of {prompt} from the cache)")
        last[key] = (prompt, output)


def _finished(response: str) -> bool:
    """An answer that got to its end: a whole JSON object, or a stream that sent its last event."""
    text = response.rstrip()
    return text.endswith("}") and not text.startswith(("event:", "data:")) or any(
        end in text for end in ("message_stop", "response.completed", "response.incomplete", "data: [DONE]"))


def _conversation(body: dict) -> str:
    """What stays the same through one conversation: its system prompt, or its first message."""
    first = body.get("system") or body.get("instructions") or (
        body.get("messages") or body.get("input") or [None])[0]
    return json.dumps(first, sort_keys=True)


# --- Anthropic ---------------------------------------------------------------------------------------------
def anthropic_round_trip(body: dict) -> bool:
    """A tool_result answering a tool_use of the assistant's turn before it."""
    used, answered = set(), set()
    for m in body.get("messages", []):
        for block in m["content"] if isinstance(m["content"], list) else []:
            if block.get("type") == "tool_use":
                used.add(block["id"])
            elif block.get("type") == "tool_result":
                answered.add(block["tool_use_id"])
    return bool(used & answered)


def anthropic_usage(response: str) -> tuple[int, int, int]:
    """(prompt tokens, cached, output) from a message or the message_delta event of its stream."""
    usage = _last_sse(response, "usage") or json.loads(response)["usage"]
    cached = usage["cache_read_input_tokens"]
    return usage["input_tokens"] + cached, cached, usage["output_tokens"]


# --- Responses ---------------------------------------------------------------------------------------------
def responses_round_trip(body: dict) -> bool:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
    return any(i.get("type") == "function_call_output" and i.get("call_id") in calls for i in items)


def responses_usage(response: str) -> tuple[int, int, int]:
    usage = (_last_sse(response, "response") or {}).get("usage") or json.loads(response)["usage"]
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"]


# --- OpenAI chat -------------------------------------------------------------------------------------------
def chat_round_trip(body: dict) -> bool:
    calls, answered = set(), set()
    for m in body.get("messages", []):
        calls |= {c["id"] for c in m.get("tool_calls") or []}
        if m["role"] == "tool":
            answered.add(m.get("tool_call_id"))
    return bool(calls & answered)


def chat_usage(response: str) -> tuple[int, int, int]:
    usage = _last_sse(response, "usage") or json.loads(response)["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]


def _last_sse(response: str, key: str):
    """The last SSE event's ``key`` that has one (None for an answer that was not a stream)."""
    found = None
    for line in response.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            value = json.loads(line[6:]).get(key)
            if value:
                found = value
    return found
