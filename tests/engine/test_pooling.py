"""Pooling requests (``SamplingParams.pooling``, the embedding models' path through the engine): a prompt's
final hidden states pooled, no token generated, the KV freed. SmolLM2 q4 with f32 KV: each prompt's pooled
state is the same bits alone, batched in chunks of 16 with the others, preempted and recomputed, or (last
token) with its prefix found in the cache; and it is the contiguous reference forward's, to the last bits
the two attention paths differ by."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.engine.sampling_params import SamplingParams
from tests.support import make_engine

pytestmark = pytest.mark.slow


def prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 5000) for _ in range(40)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 5000) for _ in range(rng.randrange(5, 90))]
            for i in range(count)]


def pooled(engine, batch: list[list[int]], pooling: str, beside: int = 0) -> list[torch.Tensor]:
    """Each prompt's pooled state; ``beside``: that many generating requests, added first, grow beside
    them."""
    for i in range(beside):
        engine.add_request(list(range(100 + i, 140 + i)),
                           SamplingParams(max_tokens=60, ignore_eos=True, temperature=0))
    requests = [engine.add_request(p, SamplingParams(pooling=pooling)) for p in batch]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in {r.request_id for r in requests}:
                assert out.finish_reason == "stop" and out.token_ids == [] and out.error is None
                done[out.request_id] = out.embedding
    assert engine.kv.full.pool.num_free_blocks == engine.kv.num_blocks  # nothing held after
    return [done[r.request_id] for r in requests]


@pytest.mark.parametrize("pooling", ["last", "mean", "logits"])
def test_pooled_states_are_the_same_bits_however_the_prompt_is_run(smollm2_q4, pooling):
    batch = prompts()
    alone = [pooled(make_engine(smollm2_q4, prefix_caching=False), [p], pooling)[0] for p in batch]
    chunked = pooled(make_engine(smollm2_q4, budget=16), batch, pooling)
    # 12 blocks: two growing answers preempt the newest requests, the pooling ones, which start over
    small = make_engine(smollm2_q4, budget=16, kv_cache_memory=12 * 16 * 30 * 2 * 3 * 64 * 4,
                        prefix_caching=False)
    preempted = pooled(small, batch, pooling, beside=2)
    assert small.num_preemptions > 0
    cached = make_engine(smollm2_q4)
    pooled(cached, batch, pooling)
    again = pooled(cached, batch, pooling)
    hits = cached.kv.prefix_hits
    for way in (chunked, preempted, again):
        for got, expected in zip(way, alone, strict=True):
            assert torch.equal(got, expected)
    assert (hits > 0) == (pooling != "mean")  # a mean needs every position: it reads no cache
    model = smollm2_q4.model
    for p, got in zip(batch, alone, strict=True):
        with torch.inference_mode():
            hidden = model.forward(torch.tensor(p), torch.arange(len(p)),
                                   ContiguousKVCache(len(model.layers)))
        expected = {"last": hidden[-1], "mean": hidden.mean(0),
                    "logits": model.compute_logits(hidden[-1:])[0]}[pooling]
        assert got.shape == expected.shape
        assert torch.nn.functional.cosine_similarity(got, expected.float(), 0) > 0.99999


def test_a_pooling_request_may_fill_the_context(smollm2_q4):
    engine = make_engine(smollm2_q4, num_ctx=64)
    (vector,) = pooled(engine, [list(range(3, 67))], "last")  # 64 tokens: no room needed for a new one
    assert vector.shape == (smollm2_q4.config.hidden_size,)
    with pytest.raises(ValueError, match="pooling must be one of"):
        SamplingParams(pooling="cls")


@pytest.mark.parametrize("pooling", ["mean", "logits"])
def test_a_failed_step_starts_the_pooling_over(smollm2_q4, pooling):
    """A step that fails after some chunks were pooled: its requests run again (alone, as suspects) from
    nothing, the same bits as a clean run; nothing pooled before the failure counts twice."""
    batch = prompts()
    expected = pooled(make_engine(smollm2_q4, budget=48), batch, pooling)
    engine = make_engine(smollm2_q4, budget=48)
    real, steps = engine.runner.execute, []

    def execute(out):
        steps.append(len(out.scheduled))
        if len(steps) == 3:  # some prompts half pooled, some chunks of others cached
            raise MemoryError("kernel could not allocate")
        return real(out)

    engine.runner.execute = execute
    for got, want in zip(pooled(engine, batch, pooling), expected, strict=True):
        assert torch.equal(got, want)
    assert steps[2] > 1  # the failed step held several requests: they ran again as suspects
