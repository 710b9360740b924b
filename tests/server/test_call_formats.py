"""Each model family's own tool-call form, chosen from its chat template: Qwen3-Coder's XML, Llama 3.x's
JSON and Mistral's ``[TOOL_CALLS]`` array (Hermes is SmolLM2's and Qwen2.5's, tested everywhere else).
Tiny random models (as the architecture tests build them) carry each family's template and special
tokens; their choices are noise, so the grammar alone makes each call well formed, and the parser must
read it back: forced calls streamed and not, a tool round trip rendered by the family's template, and
``auto`` answers that are text or calls."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from kvserve.server.tools.call_formats import Llama3JsonFormat, MistralFormat, Qwen3CoderFormat, call_format
from kvserve.server.tools.definitions import Tool, ToolCall
from tests.server.conftest import serve

pytestmark = pytest.mark.slow

CONTROL = 3
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
CLOSED = {**WEATHER, "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "forecast", "description": "Weather", "parameters": WEATHER}},
         {"type": "function",
          "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]

QWEN3_CODER = """{%- if tools %}<|im_start|>system
You have access to the following functions:
<tools>
{%- for tool in tools %}
<function><name>{{ tool.function.name }}</name></function>
{%- endfor %}
</tools>
If you choose to call a function ONLY reply in the following format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% for tc in m.tool_calls %}<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. \
Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{% endif %}<|eot_id|>
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{{ {"name": m.tool_calls[0].function.name,
    "parameters": m.tool_calls[0].function.arguments} | tojson }}<|eot_id|>
{%- elif m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{- bos_token }}
{%- for m in messages %}
{%- if m.role == "user" %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]\
{% endif %}[INST]{{ m.content }}[/INST]
{%- elif m.role == "assistant" and m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls
| map(attribute="function") | list | tojson }}</s>
{%- elif m.role == "tool" %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- elif m.role == "assistant" %}{{ m.content }}</s>
{%- else %}[INST]{{ m.content }}[/INST]
{%- endif %}
{%- endfor %}"""

FAMILIES = {
    "qwen3-coder": (QWEN3_CODER, ("<|im_start|>", "<|im_end|>"), "<|im_end|>", Qwen3CoderFormat),
    "llama3-json": (LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>",
                    Llama3JsonFormat),
    "mistral": (MISTRAL, ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>"), "</s>", MistralFormat),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from tests.models.arch_builders import VOCAB, build_hf_model, write_gguf

    name = request.param
    template, specials, eos, _ = FAMILIES[name]
    path = tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"
    write_gguf(path, build_hf_model("qwen3", vocab=VOCAB + len(specials)), "qwen3",
               extra_tokens=tuple((s, CONTROL) for s in specials), chat_template=template,
               eos_token_id=VOCAB + specials.index(eos))
    for server in serve(tmp_path_factory, str(path), "-c", "1024", "--served-model-name", name):
        yield name, server


def test_each_template_picks_its_format():
    class Tok:
        def __init__(self, template):
            self.chat_template = template
            self.backend = type("B", (), {"token_to_id": staticmethod(lambda t: 9)})()

    for name, (template, _, _, kind) in FAMILIES.items():
        assert type(call_format(Tok(template))) is kind, name
    assert call_format(Tok("{{ messages }}")).name == "hermes"


def test_markers_that_are_one_token_are_named_by_id():
    class Tok:
        chat_template = "{{ messages }}"
        backend = type("B", (),
                       {"token_to_id": staticmethod({"<tool_call>": 151657, "</tool_call>": 151658}.get)})()

    rules = call_format(Tok()).rules([Tool("forecast", parameters=WEATHER)], 1)
    assert "call: <[151657]> NL (tool0) NL <[151658]>" in rules
    Tok.backend = type("B", (), {"token_to_id": staticmethod(lambda t: None)})()
    assert 'call: "<tool_call>" NL (tool0) NL "</tool_call>"' in call_format(Tok()).rules(
        [Tool("forecast")], 1)


def test_a_bare_call_is_read_alone_or_in_a_json_block():
    """Qwen2.5-Coder writes a call as the bare JSON object, often in a json code block: one of an offered tool
    is a call; anything else (another name, text around it) stays text."""
    fmt, tools = call_format(None), [Tool("forecast", parameters=WEATHER)]
    body = '{"name": "forecast", "arguments": {"city": "Paris", "days": 3}}'
    for text in (body, f"```json\n{body}\n```", f"  {body}\n"):
        text_left, calls = fmt.parse(text, tools)
        assert text_left == "" and [(c.name, c.arguments) for c in calls] == [
            ("forecast", {"city": "Paris", "days": 3})]
    for text in ('{"name": "other", "arguments": {}}', f"Here: {body}", "```python\nprint(1)\n```"):
        assert fmt.parse(text, tools) == (text, [])
    assert fmt.parse(body) == (body, [])  # no tools offered: text
    assert fmt.may_start("```js") and fmt.may_start("{") and not fmt.may_start("Sure")


def test_each_parser_reads_what_its_template_writes():
    # the calls of an assistant turn, as the family's template renders them, read back by its parser
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    call = ToolCall("forecast", {"city": "Paris", "days": 3})
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": call.id, "function": {"name": call.name, "arguments": call.arguments}}]}
    for name, (template, specials, eos, kind) in FAMILIES.items():
        text = env.from_string(template).render(messages=[message], tools=None, bos_token="", eos_token=eos)
        body = text.split("assistant<|end_header_id|>\n\n")[-1].split("<|im_start|>assistant\n")[-1]
        for token in (eos, "<|eot_id|>"):
            body = body.replace(token, "")
        fmt = kind(None) if kind is MistralFormat else kind()
        _, calls = fmt.parse(body.strip(), [Tool("forecast", parameters=WEATHER)])
        assert [(c.name, c.arguments) for c in calls] == [(call.name, call.arguments)], (name, body)


def _client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_forced_calls_parse_and_validate(family):
    name, server = family
    client = _client(server)
    for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
        whole = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice=choice,
                                               temperature=0, max_tokens=200)
        with client.chat.completions.stream(model=name, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            temperature=0, max_tokens=200) as stream:
            streamed = stream.get_final_completion()
        for r in (whole, streamed):
            assert r.choices[0].finish_reason == "tool_calls", r
            [call] = r.choices[0].message.tool_calls
            if call.function.name == "forecast":
                jsonschema.validate(json.loads(call.function.arguments), CLOSED)
        assert whole.choices[0].message.tool_calls[0].function.arguments == \
            streamed.choices[0].message.tool_calls[0].function.arguments
    # written in the family's own form (the tokens as sampled)
    r = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=200, logprobs=True)
    written = "".join(t.token for t in r.choices[0].logprobs.content)
    marker = {"qwen3-coder": "<tool_call>\n<function=", "llama3-json": '{"name": "',
              "mistral": "[TOOL_CALLS][{"}[name]
    assert written.startswith(marker), written


def test_a_round_trip_and_auto_answers(family):
    name, server = family
    client = _client(server)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "forecast", "arguments": json.dumps({"city": "Paris", "days": 3})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=name, messages=messages, tools=TOOLS, temperature=0,
                                       max_tokens=40)
    assert r.usage.prompt_tokens > 40 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for seed in range(3):
        r = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=60)
        message = r.choices[0].message
        if message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            assert message.content is not None
    ollama = httpx.post(f"{server.url}/api/chat", headers=server.headers, timeout=120, json={
        "model": name, "messages": ASK, "tools": TOOLS, "stream": False,
        "options": {"temperature": 0, "num_predict": 60}})
    assert ollama.status_code == 200


def test_an_echoed_call_is_rendered_as_written_only_when_unchanged():
    from kvserve.server.tools import WrittenCalls, messages_for_template

    written = WrittenCalls(capacity=2)
    call = ToolCall("forecast", {"city": "Paris", "days": 3}, "call_abc")
    raw = '{"name": "forecast", "arguments": {"city": "Paris", "days": 3}}'
    written.remember(raw, "", [call])
    echo = {"role": "assistant", "content": "",
            "tool_calls": [ToolCall("forecast", {"city": "Paris", "days": 3},
                                                                         "toolu_abc")]}
    assert written.written(echo) == raw  # the Anthropic id of the same call
    changed = {**echo, "tool_calls": [ToolCall("forecast", {"city": "Lyon", "days": 3}, "call_abc")]}
    assert written.written(changed) is None
    assert written.written({**echo, "content": "Let me look."}) is None
    messages, _ = messages_for_template([{"role": "user", "content": "hi"}, echo], [Tool("forecast")], True,
                                        written)
    assert messages[1] == {"role": "assistant", "content": raw}
    for i in range(3):  # the oldest answers are forgotten
        written.remember("x", "", [ToolCall("noop", {}, f"call_{i}")])
    assert written.written(echo) is None
