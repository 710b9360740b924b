"""Context shift (``--context-overflow shift``): a request that outgrows the context keeps its first
``num_keep`` tokens, drops the older half of the rest and goes on. Checked against doing it by hand:
each segment run by an engine without shifting, the next started from the shifted tokens; SmolLM2 as
served (q4 weights), so the same bits are expected, compared with ==."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import PromptTooLongError
from tests.support import make_engine

CTX = 96


def _engine(loaded, ctx=CTX, overflow="shift", num_keep=4, speculative=None):
    base = make_engine(loaded, num_ctx=ctx, max_num_seqs=2)
    scheduler = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, context_overflow=overflow,
                                num_keep=num_keep)
    config = replace(base.config, scheduler=scheduler)
    if speculative:
        config = replace(config, speculative=SpeculativeConfig("ngram", speculative))
    return LLMEngine(config, loaded)


def _by_hand(loaded, prompt, max_tokens, keep):
    """Segments run without shifting, each on an engine whose context ends where the shift happens
    (one token later than a non-shifting request stops: the newest token has no position then)."""
    plain = _engine(loaded, ctx=CTX + 1, overflow="error")
    tokens, out, shifts = list(prompt), [], 0
    while len(out) < max_tokens:
        params = SamplingParams(temperature=0, max_tokens=max_tokens - len(out), ignore_eos=True)
        rid = plain.add_request(tokens, params).request_id
        gen = plain.run_to_completion()[rid].token_ids
        out += gen
        tokens += gen
        if len(out) < max_tokens:
            keep_now = min(keep, CTX // 2)
            tokens = tokens[:keep_now] + tokens[keep_now + (len(tokens) - keep_now) // 2 :]
            shifts += 1
    return out, shifts


@pytest.mark.parametrize("keep", [4, 20])
def test_a_shifted_request_goes_on_as_if_started_from_the_shifted_tokens(smollm2_q4, check_no_leaks, keep):
    prompt = smollm2_q4.tokenizer.encode("Count slowly and explain each number: one, two, three,")
    expected, shifts = _by_hand(smollm2_q4, prompt, 160, keep)
    assert shifts >= 2
    engine = _engine(smollm2_q4, num_keep=keep)
    check_no_leaks.append(engine)
    rid = engine.add_request(prompt,
                             SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)).request_id
    out = engine.run_to_completion()[rid]
    assert out.token_ids == expected and out.finish_reason == "length"
    assert out.metrics.num_context_shifts == shifts == engine.scheduler.num_context_shifts
    per_request = _engine(smollm2_q4, num_keep=0)  # num_keep of the request wins over the engine's
    rid = per_request.add_request(prompt, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True,
                                                         num_keep=keep)).request_id
    assert per_request.run_to_completion()[rid].token_ids == expected


def test_shifting_with_speculation_changes_nothing(smollm2_q4, check_no_leaks):
    tok = smollm2_q4.tokenizer
    prompt = tok.encode("red green blue red green blue red green blue red")
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    plain = _engine(smollm2_q4)
    rid = plain.add_request(prompt, params).request_id
    expected = plain.run_to_completion()[rid]
    fast = _engine(smollm2_q4, speculative=4)
    check_no_leaks.append(fast)
    rid = fast.add_request(prompt, params).request_id
    got = fast.run_to_completion()[rid]
    assert got.token_ids == expected.token_ids and expected.metrics.num_context_shifts > 0
    assert fast.num_accepted_tokens > 0


def test_a_too_long_prompt_is_shifted_or_refused(smollm2_q4):
    prompt = smollm2_q4.tokenizer.encode("word " * 200)
    assert len(prompt) > CTX
    with pytest.raises(PromptTooLongError):
        _engine(smollm2_q4, overflow="error").add_request(prompt)
    engine = _engine(smollm2_q4, num_keep=10)
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert list(request.prompt_token_ids) == prompt[:10] + prompt[len(prompt) - (CTX - 10) // 2 :]
    assert len(engine.run_to_completion()[request.request_id].token_ids) == 4


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="context-overflow"):
        SchedulerConfig(context_overflow="wrap")
    with pytest.raises(ValueError, match="num_keep"):
        SamplingParams(num_keep=-1)
