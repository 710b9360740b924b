"""Client schemas that compile but cannot be followed, on all three APIs: a 400 with a short message of
ours at admission (never a 500, never the grammar library's parser state), streamed or not, and the
server serving the next request as before."""

from __future__ import annotations

import httpx
import pytest

from kvserve.engine.constraints import MAX_SPEC_BYTES, Constraint, GrammarTokenizer, compiled

pytestmark = pytest.mark.slow

SELF = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
DEFS = {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/N"}}, "required": ["a"]}
ASK = [{"role": "user", "content": "Hi"}]


def _bodies(schema):
    return [
        ("/v1/chat/completions", {"model": "smollm2", "messages": ASK, "max_tokens": 8,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "s", "schema": schema}}}),
        ("/v1/messages", {"model": "smollm2", "messages": ASK, "max_tokens": 8,
                          "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
        ("/api/chat", {"model": "smollm2", "messages": ASK, "format": schema, "options": {"num_predict": 8}}),
    ]


@pytest.mark.parametrize("schema", [SELF, DEFS], ids=["self-reference", "recursive-defs"])
def test_unfollowable_schemas_are_400s(idle, schema):
    for path, body in _bodies(schema):
        for stream in (False, True):
            r = httpx.post(f"{idle.url}{path}", json={**body, "stream": stream}, headers=idle.headers,
                           timeout=60)
            assert r.status_code == 400, (path, stream, r.text)
            assert "<state>" not in r.text and len(r.text) < 1000 and "cannot be followed" in r.text
    ok = httpx.post(f"{idle.url}/v1/chat/completions", headers=idle.headers, timeout=60,
                    json={"model": "smollm2", "messages": ASK, "max_tokens": 4})
    assert ok.status_code == 200


def test_a_grammar_too_large_is_refused_before_compiling(smollm2_q4):
    gt = GrammarTokenizer(smollm2_q4.tokenizer)
    with pytest.raises(ValueError, match="at most"):
        compiled(Constraint.json_schema({"const": "x" * MAX_SPEC_BYTES}), gt)
    again = compiled(Constraint.json_schema({"type": "integer"}), gt)
    assert compiled(Constraint.json_schema({"type": "integer"}), gt) is again  # compiled once, kept
