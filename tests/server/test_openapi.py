"""The OpenAPI document tells the truth: schemathesis sends generated requests (valid and invalid) to
every operation of the live server and checks that none answers 5xx and that every response has a
documented status code, a documented content type, and a body (each SSE event, each NDJSON line) that
matches its documented schema. The document's shape is checked in-process first.

Generation is kept short (a few tokens a request) by ``bounded``, which also sends the served model's
name most of the time, so that requests get past the 404 and generate.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvserve.server import ServerConfig
from kvserve.server.middleware import OPEN_PATHS
from kvserve.server.ollama import schemas as ollama_schemas
from kvserve.server.openai import chat_schemas as openai_schemas
from tests.server.stub_engine import make_client

MODEL = "smollm2"
MAX_TOKENS = 3
MAX_EXAMPLES = 30  # per operation and mode


def positive_data_accepted(ctx, response, case) -> None:
    """Every request the document allows is taken (schemathesis' ``positive_data_acceptance``), but for a
    prompt longer than the server's context (a limit of this server's setup, ``--num-ctx``, not of the
    request's shape: refused as OpenAI refuses it, with a 400 naming the limit) and a client's JSON Schema
    that cannot be enforced or satisfied (which no schema of schemas can tell: a 400 saying which), and
deleting the served model (a 409)."""
    if response.status_code == 400 and "context limit is" in response.text:
        return None
    if response.status_code == 400 and "the JSON schema " in response.text:
        # a client's own schema: its nested keywords and satisfiability are checked by compiling it
        return None
    if response.status_code == 409 and case.operation.path == "/api/delete":
        return None  # the served model, which ``bounded`` names: not deleted while served
    return positive_data_acceptance(ctx, response, case)


CHECKS = [
    not_a_server_error,
    positive_data_accepted,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
NDJSON = "application/x-ndjson"


def test_the_document_lists_what_the_server_answers():
    def document(api_key: str | None) -> dict:
        config = ServerConfig(model_name="stub", api_key=api_key)
        return make_client(RuntimeError("unused"), config)[0].get("/openapi.json").json()

    doc = document("key")
    assert not any("__" in name for name in doc["components"]["schemas"])  # no two models share a name
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert "422" not in statuses and "500" in statuses, (method, path)
            assert ("401" in statuses) == (path not in OPEN_PATHS), (method, path)
            if method == "post":
                assert {"400", "413"} <= statuses, path
            error = operation["responses"]["500"]["content"]["application/json"]["schema"]["$ref"]
            expected = "OllamaError" if path.startswith("/api/") else "OpenAIError"
            assert error.endswith("AnthropicError" if path.startswith("/v1/messages") else expected)
    # a full queue: OpenAI 429, Ollama 503 (as Ollama answers it)
    streams = {
        "/v1/chat/completions": ("text/event-stream", {"400", "404", "429", "503"}),
        "/v1/completions": ("text/event-stream", {"400", "404", "429", "503"}),
        "/api/generate": (NDJSON, {"400", "404", "503"}),
        "/api/chat": (NDJSON, {"400", "404", "503"}),
    }
    for path, (media_type, errors) in streams.items():
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "401", "413", "500"} | errors, path
        assert set(responses["200"]["content"]) == {"application/json", media_type}
        assert "itemSchema" in responses["200"]["content"][media_type]
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    open_doc = document(None)
    assert "securitySchemes" not in open_doc["components"]
    assert not any("401" in op["responses"] for ops in open_doc["paths"].values() for op in ops.values())


def test_the_document_says_what_the_served_model_takes(server):
    """SmolLM2: 49,152 token ids, no fill-in-the-middle tokens, no thought: the document allows only those,
    and none of the markers the schemas leave for it to fill in is left."""
    doc = httpx.get(f"{server.url}/openapi.json", headers=server.headers).json()
    assert "x-kvserve" not in json.dumps(doc)
    assert "/infill" not in doc["paths"]
    schemas = doc["components"]["schemas"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {
        "type": "integer", "minimum": 0, "maximum": 49151}
    assert schemas["GenerateRequest"]["properties"]["suffix"] == {"not": {}}
    assert schemas["GenerateRequest"]["properties"]["think"] == {
        "anyOf": [{"const": False}, {"type": "null"}]}
    bias = schemas["ChatCompletionRequest"]["properties"]["logit_bias"]["anyOf"][1]
    pattern = re.compile(bias["propertyNames"]["pattern"])
    taken = [str(n) for n in (0, 7, 49151, 10000, 39999)]
    refused = ["49152", "50000", "100000", "-1", "1.0", ""]
    assert all(pattern.match(n) for n in taken) and not any(pattern.match(n) for n in refused)


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# fields refused unless they ask for nothing: dropped from most requests, so that most get to generate
REFUSED = {*openai_schemas.NEUTRAL_VALUES, *ollama_schemas.NEUTRAL_VALUES}
STREAMING = {"/v1/chat/completions", "/v1/completions", "/api/generate", "/api/chat"}
LIMITS = {  # each generating path's fields that cap the tokens generated
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/messages": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
    "/infill": ("n_predict",),
}
POOL_STREAM = "/v1/kvserve/cache/stream"
REFUSED_IN_MESSAGES = {"refusal", "tool_calls", "function_call", "audio", "images", "thinking", "tool_name"}


def bounded(path: str, body: object) -> None:
    """Few tokens per request and few choices; mostly the served model and no refused fields, so that
    most requests generate. Values of the wrong type are left alone: they must still get a 400."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and len(body["model"]) % 4 != 1:
        _ask_the_served_model(path, body)
    if path in LIMITS:
        _cap_limits(path, body)
    elif path in STREAMING:
        _cap_num_predict(body)


def _ask_the_served_model(path: str, body: dict) -> None:
    """The served model, without the refused fields, with a prompt or messages where Ollama would take
    the request for a "load", and streaming or not where the request leaves it to the default."""
    body["model"] = MODEL
    _drop(body, REFUSED)
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        _drop(message, REFUSED_IN_MESSAGES)
    _drop(body.get("options"), REFUSED)
    _choose_a_given_tool(body)
    if path == "/api/generate" and body.get("prompt") is None:
        body["prompt"] = "Hi"  # without one Ollama answers a "load" object, not a stream
    if path == "/api/chat" and body.get("messages") is None:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    if path in STREAMING and body.get("stream") is None:
        body["stream"] = len(repr(body)) % 2 == 0  # about half of them, whatever the default


def _cap_limits(path: str, body: dict) -> None:
    """A path of ``LIMITS``: its token caps at most MAX_TOKENS (the first set where none is) and n at most
    2; integers only, values of another type left for the server to refuse."""
    for key in LIMITS[path]:
        if _is_int(body.get(key)) and not 0 < body[key] <= MAX_TOKENS:
            body[key] = MAX_TOKENS
    if all(body.get(key) is None for key in LIMITS[path]):
        body[LIMITS[path][0]] = MAX_TOKENS  # chat's default is the whole context
    if _is_int(body.get("n")) and body["n"] > 2:
        body["n"] = 2


def _cap_num_predict(body: dict) -> None:
    """An Ollama request: options.num_predict at most MAX_TOKENS (set where missing); options or a
    num_predict of another type left for the server to refuse."""
    if body.get("options") is None:
        body["options"] = {}
    options = body["options"]
    if isinstance(options, dict):
        predict = options.get("num_predict")
        if predict is None or _is_int(predict) and not 0 < predict <= MAX_TOKENS:
            options["num_predict"] = MAX_TOKENS  # Ollama's default is the whole context too


def bounded_stream(path: str, query: dict | None) -> dict | None:
    """The pool stream runs until the client leaves: a few frames each. A value of the wrong type is left
    alone: it must still get a 400."""
    if path != POOL_STREAM:
        return query
    query = dict(query or {})
    events = query.get("max_events")
    if events is None or isinstance(events, list) or _is_int(events) and events > 2 or str(events).isdigit():
        query["max_events"] = 2
    return query


def _choose_a_given_tool(body: dict) -> None:
    """Tools have distinct names and a forced tool names one of them, as the model names the served one:
    what JSON Schema cannot check (either broken is a 400, as in OpenAI and Anthropic). Values of another
    type are left for the server to refuse."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    # OpenAI's chat tools hold their name in "function"; Anthropic's and the Responses API's, at the top
    holders = [t.get("function") if isinstance(t, dict) and "function" in t else t for t in tools]
    names: list[str] = []
    for i, holder in enumerate(holders):
        if isinstance(holder, dict) and isinstance(holder.get("name"), str):
            if holder["name"] in names:
                holder["name"] = f"{holder['name']}_{i}"[-64:]
            names.append(holder["name"])
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return
    if not names:
        del body["tool_choice"]
    elif isinstance(choice.get("function"), dict):
        choice["function"]["name"] = names[0]
    elif "name" in choice:
        choice["name"] = names[0]


def _drop(obj: object, keys: set[str]) -> None:
    if isinstance(obj, dict):
        for key in keys & obj.keys():
            del obj[key]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def ndjson_lines_conform(ctx, response, case) -> None:
    """Each line of an NDJSON stream matches the ``itemSchema`` the document gives for it (schemathesis
    checks SSE events itself, but reads no NDJSON)."""
    if not response.headers.get("content-type", [""])[0].startswith(NDJSON):
        return
    document = case.operation.schema.raw_schema
    content = document["paths"][case.operation.path][case.method.lower()]["responses"]["200"]["content"]
    validator = jsonschema_rs.Draft202012Validator(
        {**content[NDJSON]["itemSchema"], "components": document["components"]}
    )
    lines = response.content.decode().splitlines()
    assert lines, "an empty NDJSON stream"
    for number, line in enumerate(lines, 1):
        errors = [e.message for e in validator.iter_errors(json.loads(line))]
        assert not errors, f"NDJSON line {number} does not match its schema: {errors}\n{line}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(GenerationMode))
def test_every_response_is_documented(api, server, mode):
    """Every operation, up to ``MAX_EXAMPLES`` generated requests each: positive ones fit the request
    schema, negative ones break it somewhere (and must get a documented 4xx, never a 5xx)."""
    failures: list[str] = []
    answers: Counter[tuple[int, str]] = Counter()  # (status, media type): what the requests exercised
    operations = [result.ok() for result in api.get_all_operations()]
    for operation in operations:
        takes_input = operation.method.upper() == "POST" or "{" in operation.path

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES if takes_input else 2,
            deadline=None,
            derandomize=True,  # the same requests every run
            database=None,
            phases=[Phase.generate],  # no shrinking: the first failure of each operation, as it came
            suppress_health_check=list(HealthCheck),
        )
        def run(case) -> None:
            bounded(case.path, case.body)
            case.query = bounded_stream(case.path, case.query)
            response = case.call_and_validate(
                headers=server.headers,
                checks=CHECKS,
                additional_checks=[ndjson_lines_conform],
                timeout=120,  # schemathesis' default of 10 s is short for a busy two-core machine
            )
            media_type = response.headers.get("content-type", [""])[0].split(";")[0]
            answers[response.status_code, media_type] += 1

        try:
            run()
        except Unsatisfiable:  # nothing to break in a request without parameters or body
            assert mode is GenerationMode.NEGATIVE and not takes_input
        except (Exception, FailureGroup) as e:  # noqa: BLE001 - every operation's failure is reported
            failures.append(f"{operation.label}: {e if isinstance(e, FailureGroup) else repr(e)}")
    print(f"\n{mode}: {len(operations)} operations, {answers.total()} requests, {len(failures)} failing")
    print(", ".join(f"{status} {media}: {n}" for (status, media), n in sorted(answers.items())))
    assert not failures, "\n\n".join(failures)
