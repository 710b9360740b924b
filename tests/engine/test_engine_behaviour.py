"""Engine behaviour beyond exactness: sampling, stops, limits, aborts, prefix reuse, the Python API."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import PromptTooLongError
from tests.support import make_engine


def _prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(n)]


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_llama, check_no_leaks):
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = make_engine(tiny_llama)
    check_no_leaks.append(alone)
    [first] = [alone.add_request(_prompt(30), params).request_id]
    solo = alone.run_to_completion()[first].token_ids
    batched = make_engine(tiny_llama)
    check_no_leaks.append(batched)
    others = [batched.add_request(_prompt(20, s),
                                  SamplingParams(temperature=1.0, max_tokens=20)) for s in range(5)]
    rid = batched.add_request(_prompt(30), params).request_id
    assert others
    assert batched.run_to_completion()[rid].token_ids == solo


def test_different_seeds_differ(tiny_llama):
    engine = make_engine(tiny_llama)
    ids = [engine.add_request(_prompt(10),
                              SamplingParams(temperature=1.5, seed=s, max_tokens=30, ignore_eos=True))
           .request_id for s in (1, 2)]
    final = engine.run_to_completion()
    assert final[ids[0]].token_ids != final[ids[1]].token_ids


def test_max_tokens_and_stop_token_ids(tiny_llama):
    engine = make_engine(tiny_llama)
    rid = engine.add_request(_prompt(10),
                             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)).request_id
    out = engine.run_to_completion()[rid]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    stop_at = out.token_ids[3]
    rid = engine.add_request(_prompt(10),
                             SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[stop_at])).request_id
    out2 = engine.run_to_completion()[rid]
    first = out.token_ids.index(stop_at)
    assert out2.token_ids == out.token_ids[: first + 1]
    assert out2.finish_reason == "stop" and out2.stop_reason == stop_at


def test_context_limit_finishes_with_length(tiny_llama):
    engine = make_engine(tiny_llama, num_ctx=40)
    rid = engine.add_request(_prompt(30),
                             SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)).request_id
    out = engine.run_to_completion()[rid]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_prompt_too_long_is_a_clear_error(tiny_llama):
    engine = make_engine(tiny_llama, num_ctx=32)
    with pytest.raises(PromptTooLongError, match="32 tokens but the context limit is 32"):
        engine.add_request(_prompt(32))
    assert not engine.has_unfinished_requests()


def test_bad_params_and_token_ids_raise_value_error(tiny_llama):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 2, 10_000])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])


def test_abort_mid_generation_frees_blocks(tiny_llama, check_no_leaks):
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    keep = engine.add_request(_prompt(50), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    drop = engine.add_request(_prompt(70, 2), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.block_ids(drop.request_id)
    out = engine.abort_request(drop.request_id)
    assert out.finished and out.finish_reason == "abort"
    assert engine.kv.block_ids(drop.request_id) == []
    final = engine.run_to_completion()
    assert len(final[keep.request_id].token_ids) == 20


def test_logprobs_of_chosen_and_top_tokens(tiny_llama):
    engine = make_engine(tiny_llama)
    rid = engine.add_request(_prompt(10),
                             SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                            ignore_eos=True)).request_id
    out = engine.run_to_completion()[rid]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the chosen token is the most likely
        assert lp.top[0][2] >= lp.top[1][2] >= lp.top[2][2]


@pytest.mark.slow
def test_shared_1000_token_prefix_is_served_from_cache(smollm2, check_no_leaks):
    engine = make_engine(smollm2, num_ctx=1200, max_num_seqs=2)
    check_no_leaks.append(engine)
    prefix = _prompt(1000, 7)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = engine.add_request(prefix + [100, 101], params).request_id
    out1 = engine.run_to_completion()[first]
    second = engine.add_request(prefix + [200, 201, 202], params).request_id
    out2 = engine.run_to_completion()[second]
    assert out1.metrics.num_cached_tokens == 0
    assert out2.metrics.num_cached_tokens >= 992
    # the work behind the TTFT (not the clock: tests assert no wall time): 11 prompt tokens computed, not 1003
    assert out2.metrics.num_prompt_tokens - out2.metrics.num_cached_tokens == 1003 - 992


@pytest.mark.slow
def test_stop_strings_and_streamed_text(smollm2):
    engine = make_engine(smollm2)
    tok = smollm2.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30)).request_id
    full = engine.run_to_completion()[rid]
    assert "Paris" in full.text
    stop = "Paris"
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop])).request_id
    pieces = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.delta_text)
            final = out
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[: full.text.index(stop)]
    assert "".join(pieces) == final.text  # streamed deltas add up and never contain the stop string


def _wait_until_idle(engine, seconds: float = 10.0) -> None:
    """Aborts are handed to the engine thread; give it (bounded) time to drain them."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with engine.lock:
            if not engine.engine.has_unfinished_requests() and not engine._pending:
                return
        time.sleep(0.01)
    raise AssertionError("the engine did not drain its aborts")


def test_async_engine_streams_and_aborts_on_disconnect(tiny_llama):
    engine = make_engine(tiny_llama)
    async_engine = AsyncLLMEngine(engine)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = [o async for o in async_engine.generate(_prompt(20), params)]
        assert outs[-1].finished and len(outs[-1].token_ids) == 12
        assert [len(o.token_ids) for o in outs] == list(range(1, 13))
        stream = async_engine.generate(_prompt(20, 3),
                                       SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        async for out in stream:
            if len(out.token_ids) == 3:
                break
        await stream.aclose()  # what a server does when the client goes away

    try:
        asyncio.run(main())
        _wait_until_idle(async_engine)
        assert engine.kv.full.pool.num_free_blocks == engine.kv.num_blocks
    finally:
        async_engine.shutdown()


def test_async_engine_abort_from_elsewhere_ends_the_stream(tiny_llama):
    engine = make_engine(tiny_llama)
    async_engine = AsyncLLMEngine(engine)

    async def main():
        outs = []
        async for out in async_engine.generate(_prompt(20), SamplingParams(temperature=0, max_tokens=10_000,
                                                                           ignore_eos=True), request_id="x"):
            outs.append(out)
            if len(outs) == 2:
                async_engine.abort("x")
        return outs

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        _wait_until_idle(async_engine)
        assert engine.kv.full.pool.num_free_blocks == engine.kv.num_blocks
    finally:
        async_engine.shutdown()


def test_a_stopped_engine_ends_its_streams_and_refuses_more(tiny_llama):
    """A model unloaded while a request streams: the stream ends with the reason (nobody waits on an engine
    that no longer steps), and a request that comes after is refused with it."""
    from kvserve.engine.async_engine import EngineShutdownError

    async_engine = AsyncLLMEngine(make_engine(tiny_llama))
    endless = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)

    async def main():
        seen = 0
        with pytest.raises(EngineShutdownError, match="unloaded"):
            async for _ in async_engine.generate(_prompt(20), endless):
                seen += 1
                if seen == 2:
                    await asyncio.to_thread(async_engine.shutdown, "model 'tiny' was unloaded")
        with pytest.raises(EngineShutdownError, match="unloaded"):
            await async_engine.generate(_prompt(4), endless).__anext__()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_async_engine_rejects_bad_requests_before_any_await(tiny_llama):
    engine = make_engine(tiny_llama, num_ctx=32)
    async_engine = AsyncLLMEngine(engine)

    async def first(prompt, params=None):
        return await async_engine.generate(prompt, params).__anext__()

    try:
        with pytest.raises(PromptTooLongError):
            asyncio.run(first(_prompt(40)))
        with pytest.raises(ValueError, match="seed"):
            asyncio.run(first(_prompt(4), SamplingParams(seed=2**70)))
        assert not engine.has_unfinished_requests()
    finally:
        async_engine.shutdown()


def test_python_api_generate_and_stream(tiny_llama):
    from kvserve.llm import LLM

    llm = LLM.__new__(LLM)  # reuse the loaded tiny model instead of loading from disk again
    llm.engine = make_engine(tiny_llama)
    llm.tokenizer = None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([_prompt(10), _prompt(12, 2)], params)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    streamed = list(llm.stream(_prompt(10), params))
    assert streamed[-1].token_ids == outs[0].token_ids
    partial = llm.stream(_prompt(10), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(partial)
    partial.close()
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_engine_kv_bytes_per_token_match_the_formula_for_every_type(smollm2):
    """2 x layers x kv_heads x head_dim x bits / 8, and the pool is exactly blocks x that."""
    from kvserve.kv.cache_types import KV_TYPES

    c = smollm2.config
    for name, spec in KV_TYPES.items():
        engine = make_engine(smollm2, num_ctx=64, max_num_seqs=1, cache_type_k=name)
        expected = 2 * c.num_layers * c.num_kv_heads * c.head_dim * spec.bits_per_element(c.head_dim) / 8
        assert engine.kv_bytes_per_token == expected, name
        assert engine.kv_pool_bytes == engine.kv.num_blocks * 16 * expected, name


def test_outputs_share_nothing_with_the_live_request(tiny_llama, check_no_leaks):
    """An output handed to another thread must not change as the engine goes on."""
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    rid = engine.add_request(_prompt(12), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                         logprobs=1)).request_id
    first = second = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and len(out.token_ids) == 2:
                first = (out, list(out.token_ids), list(out.metrics.itls), len(out.logprobs))
            if out.request_id == rid and out.finished:
                second = out
    out, tokens, itls, num_logprobs = first
    assert (out.token_ids, out.metrics.itls, len(out.logprobs)) == (tokens, itls, num_logprobs)
    assert len(second.token_ids) == 6 and len(second.metrics.itls) == 5
    assert isinstance(out.prompt_token_ids, tuple)


def test_generate_wants_one_params_per_prompt(tiny_llama):
    from kvserve.llm import LLM

    llm = LLM.__new__(LLM)  # the engine without a second model load
    llm.engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams()] * 3)
    assert not llm.engine.has_unfinished_requests()
