"""What coding agents and editor plugins send that no other client does, each answered as they need it: the
shapes of Claude Code's, Codex CLI's and llama.vim's requests (written here from what those clients send),
the field policy (a field that cannot change the answer is accepted and ignored, one that would and that
this server cannot honour is a 400 naming it), and the small things agents read (models, HEAD /, usage)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Claude Code's TaskCreate-style parameters: keys of any name (propertyNames: every JSON key is a string)
METADATA_TOOL = {"name": "TaskCreate", "description": "Create a task", "input_schema": {
    "type": "object", "properties": {"subject": {"type": "string", "maxLength": 20},
                                     "metadata": {"type": "object", "propertyNames": {"type": "string"}}},
    "required": ["subject"]}}


def _post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**server.headers, **headers}, timeout=120)


def _message(**extra) -> dict:
    return {"model": "smollm2", "max_tokens": 8, "temperature": 0, "messages": ASK, **extra}


# --- Claude Code --------------------------------------------------------------------------------------------
def test_claude_codes_first_request_is_answered(idle):
    """A mid-conversation system turn, context_management, adaptive thinking, effort, billing metadata, a tool
    whose schema has keywords the grammar cannot enforce and the tool fields Anthropic's tool search reads."""
    tool = {**METADATA_TOOL, "eager_input_streaming": True, "defer_loading": False, "strict": False,
            "input_examples": [{"subject": "x"}], "allowed_callers": ["direct"],
            "cache_control": {"type": "ephemeral"}}
    body = _message(
        system=[{"type": "text",
                 "text": "x-anthropic-billing-header: cc_version=2.1.197.6c5; cc_entrypoint=sdk-cli;"},
                {"type": "text", "text": "You are a helpful agent.", "cache_control": {"type": "ephemeral"}}],
        messages=[*ASK, {"role": "system", "content": "Available agent types: none."}],
        tools=[tool], thinking={"type": "adaptive"}, output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": json.dumps({"session_id": "s"})}, stream=True)
    r = _post(idle, "/v1/messages?beta=true", body,
              **{"anthropic-beta": "mid-conversation-system-2026-04-07"})
    assert r.status_code == 200, r.text
    events = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"


def test_a_strict_tool_with_unenforceable_keywords_is_a_400(idle):
    r = _post(idle, "/v1/messages", _message(tools=[{**METADATA_TOOL, "strict": True}],
                                             tool_choice={"type": "any"}))
    assert r.status_code == 400 and "propertyNames" in r.json()["error"]["message"]
    r = _post(idle, "/v1/messages", _message(tools=[METADATA_TOOL], tool_choice={"type": "any"}))
    # not strict: the keyword is left out of the grammar, the call follows the rest
    assert r.status_code == 200, r.text
    [use] = [b for b in r.json()["content"] if b["type"] == "tool_use"] or [None]
    assert use is None or use["name"] == "TaskCreate"


def test_clearing_tool_results_is_refused_by_name(idle):
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100}}
    r = _post(idle, "/v1/messages", _message(context_management={"edits": [edit]}))
    assert r.status_code == 400 and "clear_tool_uses_20250919" in r.json()["error"]["message"]


def test_the_billing_header_is_not_part_of_the_prompt(idle):
    """Its hash changes with each session: kept, it would sit in front of the whole prompt."""
    def count(system):
        return _post(idle, "/v1/messages/count_tokens",
                     {"model": "smollm2", "messages": ASK, "system": system}).json()

    plain = count([{"type": "text", "text": "You are a helpful agent."}])
    for header in ("cc_version=2.1.197.6c5; cc_entrypoint=cli;",
                   "cc_version=2.1.197.a01; cc_entrypoint=sdk-cli;"):
        assert count([{"type": "text", "text": f"x-anthropic-billing-header: {header}"},
                      {"type": "text", "text": "You are a helpful agent."}]) == plain


def test_claude_model_names_go_to_the_default_model(idle):
    """Claude Code's subagents and its small requests name Claude models; another name is still a 404."""
    r = _post(idle, "/v1/messages", _message(model="claude-opus-4-8"))
    assert r.status_code == 200 and r.json()["model"] == "claude-opus-4-8"
    assert _post(idle, "/v1/messages", _message(model="gpt-5")).status_code == 404


def test_the_anthropic_sdk_lists_the_models(idle):
    client = anthropic.Anthropic(base_url=idle.url, api_key=idle.api_key, max_retries=0)
    models = list(client.models.list())
    assert models[0].id == "smollm2" and models[0].type == "model" and models[0].display_name == "smollm2"
    assert httpx.head(f"{idle.url}/").status_code == 200  # Claude Code's probe


def test_a_streamed_message_says_its_usage_at_start_and_in_full_at_the_end(idle):
    r = _post(idle, "/v1/messages", _message(stream=True))
    data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    start, delta = data[0]["message"]["usage"], next(d for d in data if d["type"] == "message_delta")["usage"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] == \
        delta["input_tokens"] + delta["cache_read_input_tokens"] > 0
    assert delta["output_tokens"] >= 1


# --- Codex CLI ----------------------------------------------------------------------------------------------
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents", "tools": [
    {"type": "function", "name": "close_agent", "description": "Close an agent", "strict": False,
     "parameters": {"type": "object", "properties": {"target": {"type": "string", "maxLength": 8}},
                    "required": ["target"], "additionalProperties": False}}]}


def test_codexs_request_namespaced_and_hosted_tools(idle):
    body = {"model": "smollm2", "input": [{"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Close agent a1."}]}],
        "tools": [NAMESPACE, {"type": "web_search", "external_web_access": False}], "tool_choice": "required",
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False, "stream": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1", "temperature": 0,
        "max_output_tokens": 40, "client_metadata": {"turn_id": "t1", "x-codex-turn-metadata": "{}"}}
    r = _post(idle, "/v1/responses", body)
    assert r.status_code == 200, r.text
    assert "web_search" in r.headers["warning"]  # hosted tools are left out, and the answer says so
    [call] = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "close_agent")
    # the call sent back as Codex echoes it, with its result
    follow = {**body, "tool_choice": "auto", "input": [*body["input"], call,
                                                       {"type": "function_call_output",
                                                        "call_id": call["call_id"], "output": "closed"}]}
    assert _post(idle, "/v1/responses", follow).status_code == 200


def test_an_incomplete_response_has_an_incomplete_message(idle):
    r = _post(idle, "/v1/responses",
              {"model": "smollm2", "input": "Tell me a long story.", "max_output_tokens": 3,
                                      "temperature": 0})
    response = r.json()
    assert response["status"] == "incomplete"
    assert [item["status"] for item in response["output"]] == ["incomplete"]


# --- the policy for fields that change nothing
# ----------------------------------------------------------------
def test_fields_that_cannot_change_the_answer_are_ignored_and_others_named():
    import logging

    from kvserve.server.anthropic.schemas import MessagesRequest
    from kvserve.server.openai.responses_schemas import ResponsesRequest

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("kvserve.server.request_schema")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        for _ in range(3):
            body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "client_metadata": {"a": 1}})
        assert "client_metadata" not in body.model_dump()
        assert len([r for r in records if "client_metadata" in r.getMessage()]) == 1  # once per field name
    finally:
        logger.removeHandler(handler)
    with pytest.raises(ValueError, match="not_a_field"):  # an unknown field is still refused by name
        MessagesRequest.model_validate({**_message(), "not_a_field": 1})


def test_the_models_list_is_openais_and_anthropics(idle):
    models = httpx.get(f"{idle.url}/v1/models", headers=idle.headers).json()
    assert models["object"] == "list" and models["has_more"] is False and models["first_id"] == "smollm2"
