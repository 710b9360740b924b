"""Constrained decoding on the real SmolLM2: output follows the grammar whatever the seed, survives
preemption unchanged, and invalid grammars are refused before the request is admitted."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.engine.constraints import Constraint
from kvserve.engine.sampling_params import SamplingParams
from tests.support import make_engine

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Rome", "Berlin"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def _prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_json_schema_output_validates_for_every_seed(smollm2_q4, check_no_leaks):
    engine = make_engine(smollm2_q4, num_ctx=512)
    check_no_leaks.append(engine)
    prompt = _prompt(engine, "Describe a person as JSON with name, age and city.")
    constraint = Constraint.json_schema(SCHEMA)
    ids = [engine.add_request(prompt,
                              SamplingParams(temperature=1.0, seed=s, max_tokens=80, constraint=constraint))
           .request_id for s in range(20)]
    final = engine.run_to_completion()
    for rid in ids:
        out = final[rid]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_and_any_json_object(smollm2_q4):
    engine = make_engine(smollm2_q4, num_ctx=512)
    prompt = _prompt(engine, "What is 6 times 7?")
    regex = SamplingParams(temperature=0, max_tokens=20,
                           constraint=Constraint("regex", r"The answer is [0-9]{1,3}\."))
    obj = SamplingParams(temperature=0.8, seed=3, max_tokens=60, constraint=Constraint("json_object"))
    a, b = engine.add_request(prompt, regex).request_id, engine.add_request(prompt, obj).request_id
    final = engine.run_to_completion()
    assert final[a].finish_reason == "stop"
    assert final[a].text.startswith("The answer is ") and final[a].text.endswith(".")
    if final[b].finish_reason == "stop":  # a long object may hit max_tokens: then it is a prefix of one
        assert isinstance(json.loads(final[b].text), dict)


def test_a_constrained_request_is_unchanged_by_preemption(smollm2_q4, check_no_leaks):
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=40,
                            constraint=Constraint.json_schema(SCHEMA))
    alone = make_engine(smollm2_q4, num_ctx=512)
    prompt = _prompt(alone, "A person, as JSON.")
    rid = alone.add_request(prompt, params).request_id
    expected = alone.run_to_completion()[rid].token_ids
    # a pool of 12 blocks for 4 requests: the newest ones are preempted and recomputed
    tight = make_engine(smollm2_q4, num_ctx=512, kv_cache_memory=12 * 16 * alone.kv_bytes_per_token)
    check_no_leaks.append(tight)
    rid = tight.add_request(prompt, params).request_id
    for s in range(3):
        tight.add_request(_prompt(tight, f"Tell me about the number {s}."),
                          SamplingParams(temperature=0, max_tokens=60))
    out = tight.run_to_completion()[rid]
    assert tight.num_preemptions > 0
    assert out.token_ids == expected


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", '{"type": "nonsense"}'), "invalid json schema"),
    (Constraint("regex", "(unclosed"), "invalid regex"),
    (Constraint("lark", "start: undefined_rule"), "invalid lark"),
])
def test_invalid_grammars_are_refused_at_admission(smollm2_q4, constraint, message):
    engine = make_engine(smollm2_q4, num_ctx=512)
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2, 3], SamplingParams(constraint=constraint))
    assert not engine.has_unfinished_requests()


def test_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="constraint kind"):
        Constraint("grammar-of-my-own", "x")
