"""Speculative decoding by prompt lookup: the proposer's n-gram index, and the engine's output with
speculation on: the same token ids and logprobs, bit for bit, as without it (SmolLM2 as served: q4
weights, native kernels, f32 KV), greedy and seeded sampling, batched, constrained, preempted; and
the limits a request sets (max_tokens, stop strings) hold."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.engine.constraints import Constraint
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.speculative import NgramProposer
from tests.support import make_engine

# --- the proposer ----------------------------------------------------------------------------------------


def test_proposals_follow_the_most_recent_longest_match():
    p = NgramProposer(SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                        prompt_lookup_max=3))
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 0, 2, 3]
    assert p.propose("a", tokens, 10) == [7, 8, 0]  # "2 3" last continued with 7 (not 4): the most recent
    assert p.propose("a", tokens + [7], 10) == [8, 0, 2]  # the index grows with the tokens
    assert p.propose("a", tokens + [7], 2) == [8, 0]  # the limit
    assert p.propose("a", tokens + [7], 0) == []
    assert p.propose("b", [5, 6, 7], 4) == []  # no earlier occurrence
    longest = NgramProposer(SpeculativeConfig("ngram", 2, 1, 3))
    assert longest.propose("c", [1, 2, 9, 5, 2, 8, 1, 2], 4) == [9, 5]  # "1 2" beats the later "2"
    fresh = NgramProposer(SpeculativeConfig("ngram", 3, 1, 3))
    assert fresh.propose("a", [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], 10) == [4, 5, 9]  # "1 2 3" beats "2 3"
    p.forget("a")
    assert "a" not in p._indexes


def test_drafts_follow_what_was_kept_and_back_off_when_nothing_is():
    p = NgramProposer(SpeculativeConfig("ngram", 4, 1, 1))
    tokens = [4, 5, 6, 7, 8, 9, 4]
    assert p.propose("a", tokens, 8) == [5, 6, 7, 8]
    p.record("a", 4, 0)  # all rejected: one step without, then one draft
    assert p.propose("a", tokens, 8) == [] and p.propose("a", tokens, 8) == [5]
    p.record("a", 1, 0)  # again: two steps without
    assert [p.propose("a", tokens, 8) for _ in range(3)] == [[], [], [5]]
    p.record("a", 1, 1)  # all kept: twice as many
    assert p.propose("a", tokens, 8) == [5, 6]
    p.record("a", 2, 2)
    assert p.propose("a", tokens, 8) == [5, 6, 7, 8]
    p.record("a", 4, 2)  # two kept: three next
    assert p.propose("a", tokens, 8) == [5, 6, 7]
    for _ in range(10):
        p.record("a", 1, 0)
    assert p._indexes["a"].backoff == 16


def test_a_draft_never_runs_past_the_end_of_the_tokens():
    p = NgramProposer(SpeculativeConfig("ngram", 8, 1, 1))
    assert p.propose("a", [4, 5, 4], 8) == [5, 4]  # what followed the earlier 4, up to the end


def test_bad_settings_are_refused():
    for bad in ({"method": "medusa"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)


# --- the engine, SmolLM2 as served ----------------------------------------------------------------------

def _prompts(tok):
    para = ("The block table maps each position of a sequence to a block of the pool; full blocks are "
            "hashed so that later requests with the same prefix reuse them. ")
    return [
        tok.encode(para * 3 + para[:60]),  # repeats itself: most drafts are right
        tok.encode_chat([{"role": "user", "content": "Write the numbers from one to twenty in words."}]),
        tok.encode(
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
        ),
    ]


def _run(engine, prompts, params):
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = engine.run_to_completion()
    return [(done[i].token_ids, [lp.logprob for lp in done[i].logprobs or []]) for i in ids]


def _speculative(engine, k=4):
    return LLMEngine(replace(engine.config, speculative=SpeculativeConfig("ngram", k)), engine.loaded)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, logprobs=0),
], ids=["greedy", "seeded-sampling", "repetition-penalty"])
def test_speculation_changes_no_token_and_no_logprob(smollm2_q4, check_no_leaks, params):
    prompts = _prompts(smollm2_q4.tokenizer)
    plain = make_engine(smollm2_q4, max_num_seqs=4)
    expected = _run(plain, prompts, params)
    for k in (1, 5):
        engine = _speculative(make_engine(smollm2_q4, max_num_seqs=4), k)
        check_no_leaks.append(engine)
        assert _run(engine, prompts, params) == expected, f"k={k}"
        assert engine.runner.native_step.calls > 0
        if params.repetition_penalty == 1.0:  # (a penalized answer does not repeat its context: no drafts)
            assert engine.num_accepted_tokens > 0  # drafts were kept, so the check above means something


def test_speculation_with_a_grammar_and_under_preemption(smollm2_q4, check_no_leaks):
    tok = smollm2_q4.tokenizer
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
              "required": ["items"]}
    json_params = SamplingParams(temperature=0, max_tokens=60, constraint=Constraint.json_schema(schema))
    prompt = tok.encode_chat([{"role": "user",
                               "content": "List red, green, blue, red, green, blue as JSON."}])
    expected = _run(make_engine(smollm2_q4), [prompt], json_params)
    engine = _speculative(make_engine(smollm2_q4))
    check_no_leaks.append(engine)
    assert _run(engine, [prompt], json_params) == expected

    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = _prompts(tok) * 2
    expected = _run(make_engine(smollm2_q4, max_num_seqs=6), prompts, greedy)
    per_block = 16 * smollm2_q4.config.kv_size_per_token * 4
    small = _speculative(make_engine(smollm2_q4, max_num_seqs=6, kv_cache_memory=24 * per_block))
    check_no_leaks.append(small)
    assert _run(small, prompts, greedy) == expected
    assert small.num_preemptions > 0 and small.num_accepted_tokens > 0


def test_limits_hold_with_speculation(smollm2_q4, check_no_leaks):
    tok = smollm2_q4.tokenizer
    prompt = _prompts(tok)[0]
    engine = _speculative(make_engine(smollm2_q4), k=8)
    check_no_leaks.append(engine)
    for max_tokens in (1, 2, 5, 9):
        rid = engine.add_request(prompt,
                                 SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True)).request_id
        assert len(engine.run_to_completion()[rid].token_ids) == max_tokens
    stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["pool"])
    expected = _run(make_engine(smollm2_q4), [prompt], stop)
    before = engine.num_draft_tokens
    assert _run(engine, [prompt], stop) == expected
    assert engine.num_draft_tokens == before  # stop strings: one token at a time
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).request_id
    out = engine.run_to_completion()[rid]
    assert (
        out.metrics.num_accepted_tokens <= out.metrics.num_draft_tokens and out.metrics.num_draft_tokens > 0
    )
