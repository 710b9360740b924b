"""Quantized KV caches work with every engine feature: prefix caching, chunked prefill, batching and
preemption. K/V are encoded per token, so each mode must reproduce the greedy tokens of the same
cache type run alone (up to float near-ties, which are checked, not assumed)."""

from __future__ import annotations

import pytest

from kvserve.engine.sampling_params import SamplingParams
from tests.support import NEAR_TIE, make_engine, prompts_for

NUM_NEW = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=2)
TYPE_PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("fp8", "fp8"), ("tq4", "tq3"), ("f16", "tq2")]


def run(engine, prompts):
    ids = [engine.add_request(p, PARAMS).request_id for p in prompts]
    final = engine.run_to_completion()
    return [final[i] for i in ids]


def assert_matches(reference, outputs):
    for ref, out in zip(reference, outputs, strict=True):
        if ref.token_ids == out.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=False)) if a != b)
        top = ref.logprobs[i].top
        gap = top[0][2] - top[1][2]  # a logprob gap is the logit gap
        assert gap < NEAR_TIE, f"token {i}: {ref.token_ids[i]} vs {out.token_ids[i]}, top-2 gap {gap}"


@pytest.mark.parametrize("k_type,v_type", TYPE_PAIRS)
def test_quantized_cache_in_every_mode(tiny_llama_hd64, k_type, v_type, check_no_leaks):
    tiny_llama = tiny_llama_hd64
    prompts = prompts_for(tiny_llama, 8, seed=3)

    def engine(**kw):
        e = make_engine(tiny_llama, cache_type_k=k_type, cache_type_v=v_type, **kw)
        check_no_leaks.append(e)
        return e

    alone = engine(max_num_seqs=1, prefix_caching=False)
    reference = [run(alone, [p])[0] for p in prompts]
    assert_matches(reference, run(engine(max_num_seqs=8), prompts))  # batched
    assert_matches(reference, run(engine(budget=16), prompts))  # chunked prefill
    cached = engine()
    run(cached, prompts)
    assert_matches(reference, run(cached, prompts))  # served from the prefix cache
    assert cached.kv.prefix_hits > 0
    longest = max(len(p) for p in prompts) + NUM_NEW + 16
    per_token = cached.kv_bytes_per_token
    tight = engine(num_ctx=longest, kv_cache_memory=per_token * 2 * longest)
    assert_matches(reference, run(tight, prompts))  # with preemption
    assert tight.num_preemptions > 0


@pytest.mark.slow
def test_quantized_cache_on_smollm2_chunked_and_cached(smollm2, check_no_leaks):
    prompts = prompts_for(smollm2, 4, seed=4)
    alone = make_engine(smollm2, cache_type_k="q8_0", cache_type_v="tq4", max_num_seqs=1,
                        prefix_caching=False)
    reference = [run(alone, [p])[0] for p in prompts]
    mixed = make_engine(smollm2, cache_type_k="q8_0", cache_type_v="tq4", budget=32)
    check_no_leaks.extend([alone, mixed])
    assert_matches(reference, run(mixed, prompts))
    assert_matches(reference, run(mixed, prompts))
    assert mixed.kv.prefix_hits > 0
