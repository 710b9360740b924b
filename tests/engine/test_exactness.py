"""Greedy output of the paged engine equals the contiguous reference, whatever the engine does:
prefix caching on/off, alone or batched, whole or chunked prefill, with preemption (f32 KV).

The q4 weight format rounds activations to bf16, which turns the attention paths' last-bit
differences (paged vs contiguous) into visible ones; within the engine, its rows are computed as
they would be alone, so batched and alone agree token for token."""

from __future__ import annotations

import random

import pytest

from kvserve.engine.sampling_params import SamplingParams
from tests.support import assert_same_or_near_tie, make_engine, reference_greedy

NUM_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def prompts_for(loaded, count: int, seed: int = 0) -> list[list[int]]:
    """Token prompts of varied lengths; half share a 40-token prefix so prefix caching has work."""
    rng = random.Random(seed)
    vocab = min(loaded.config.vocab_size, 5000)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(count):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))]
        out.append(shared + tail if i % 2 else tail)
    return out


def run_engine(engine, prompts, params=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, params).request_id for p in prompts]
    final = engine.run_to_completion()
    return [final[i].token_ids for i in ids]


_REFERENCES: dict[str, tuple] = {}


@pytest.fixture(params=["tiny", "smollm2"])
def model_and_refs(request, tiny_llama):
    """The model, 8 prompts and their reference greedy tokens (computed once per model)."""
    if request.param not in _REFERENCES:
        loaded = tiny_llama if request.param == "tiny" else request.getfixturevalue("smollm2")
        prompts = prompts_for(loaded, 8)
        _REFERENCES[request.param] = loaded, prompts, [reference_greedy(loaded, p, NUM_NEW) for p in prompts]
    return _REFERENCES[request.param]


def check(loaded, prompts, refs, outputs):
    for p, ref, got in zip(prompts, refs, outputs):
        assert_same_or_near_tie(loaded, p, ref, got)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_alone_matches_reference(model_and_refs, prefix_caching, check_no_leaks):
    loaded, prompts, refs = model_and_refs
    engine = make_engine(loaded, prefix_caching=prefix_caching, max_num_seqs=1)
    check_no_leaks.append(engine)
    check(loaded, prompts, refs, [run_engine(engine, [p])[0] for p in prompts])


def test_batched_with_seven_others(model_and_refs, check_no_leaks):
    loaded, prompts, refs = model_and_refs
    engine = make_engine(loaded, max_num_seqs=8)
    check_no_leaks.append(engine)
    check(loaded, prompts, refs, run_engine(engine, prompts))


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill(model_and_refs, budget, check_no_leaks):
    loaded, prompts, refs = model_and_refs
    engine = make_engine(loaded, budget=budget, max_num_seqs=8)
    check_no_leaks.append(engine)
    check(loaded, prompts, refs, run_engine(engine, prompts))


def test_prefix_cache_hits_give_same_tokens(model_and_refs, check_no_leaks):
    loaded, prompts, refs = model_and_refs
    engine = make_engine(loaded, max_num_seqs=8)
    check_no_leaks.append(engine)
    run_engine(engine, prompts)  # fills the cache
    again = run_engine(engine, prompts)
    assert engine.kv.prefix_hits > 0
    check(loaded, prompts, refs, again)


def test_preemption_recomputes_exactly(model_and_refs, check_no_leaks):
    loaded, prompts, refs = model_and_refs
    longest = max(len(p) for p in prompts) + NUM_NEW
    # room for about two sequences at once: eight requests must preempt each other
    per_token = loaded.config.kv_size_per_token * 4
    engine = make_engine(loaded, num_ctx=longest + 16, max_num_seqs=8, kv_cache_memory=per_token * 2 * (longest + 16))
    check_no_leaks.append(engine)
    outputs = run_engine(engine, prompts)
    assert engine.num_preemptions > 0
    check(loaded, prompts, refs, outputs)


def test_q4_weights_batched_equals_alone(smollm2_q4, check_no_leaks):
    prompts = prompts_for(smollm2_q4, 6, seed=3)
    batched_engine = make_engine(smollm2_q4, max_num_seqs=8)
    alone_engine = make_engine(smollm2_q4, max_num_seqs=1, prefix_caching=False)
    check_no_leaks.extend([batched_engine, alone_engine])
    batched = run_engine(batched_engine, prompts)
    assert batched == [run_engine(alone_engine, [p])[0] for p in prompts]
