"""A forward that raises fails the requests that cause it, not the engine: the step is undone (its
blocks leave the prefix cache), several requests are retried one at a time, the others' greedy
output is what it would have been."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvserve.engine.engine import MAX_STEP_FAILURES
from kvserve.engine.sampling_params import SamplingParams
from tests.support import make_engine

POISON = 2  # a prompt holding this token makes the forward raise
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(n)]


def _fail_when(engine, should_fail) -> list[int]:
    """Wraps the runner: raises MemoryError when ``should_fail(scheduled requests)``; returns the
    list of batch sizes of the failed steps."""
    real = engine.runner.execute
    failures: list[int] = []

    def execute(out):
        if should_fail([s.request for s in out.scheduled]):
            failures.append(len(out.scheduled))
            raise MemoryError("kernel could not allocate")
        return real(out)

    engine.runner.execute = execute
    return failures


def _clean_run(tiny_llama, prompts):
    engine = make_engine(tiny_llama)
    ids = [engine.add_request(p, GREEDY).request_id for p in prompts]
    final = engine.run_to_completion()
    return [final[i].token_ids for i in ids]


def test_a_poisoned_request_fails_alone_and_the_others_are_unchanged(tiny_llama, check_no_leaks):
    prompts = [_prompt(40, s) for s in range(4)]
    poisoned = [*_prompt(20, 9), POISON, *_prompt(20, 10)]
    expected = _clean_run(tiny_llama, prompts)
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    failures = _fail_when(engine, lambda reqs: any(POISON in r.prompt_token_ids for r in reqs))
    ids = [engine.add_request(p, GREEDY).request_id for p in prompts[:2]]
    bad = engine.add_request(poisoned, GREEDY).request_id
    ids += [engine.add_request(p, GREEDY).request_id for p in prompts[2:]]
    final = engine.run_to_completion()
    assert failures[0] == 5 and failures[-1] == 1  # the batch, then the poisoned request alone
    assert final[bad].finish_reason == "error" and "MemoryError" in final[bad].error
    assert [final[i].token_ids for i in ids] == expected
    assert all(final[i].finish_reason == "length" for i in ids)
    assert engine.scheduler.suspects == set()


def test_blocks_of_a_failed_step_are_not_served_from_the_prefix_cache(tiny_llama, check_no_leaks):
    prompt = _prompt(64, 3)
    [expected] = _clean_run(tiny_llama, [prompt])
    engine = make_engine(tiny_llama, budget=32)
    check_no_leaks.append(engine)
    calls = {"n": 0}

    def second_chunk_fails(reqs):  # the forward of tokens 32..63 fails once, after they were registered
        calls["n"] += 1
        return calls["n"] == 2

    _fail_when(engine, second_chunk_fails)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).request_id
    final = engine.run_to_completion()
    assert final[rid].finish_reason == "error"  # it was alone in the failed step
    cached = {b.token_ids for b in engine.kv.full.pool.cached.values()}
    assert tuple(prompt[32:48]) not in cached and tuple(prompt[48:64]) not in cached
    assert tuple(prompt[:16]) in cached  # computed before the failure: still valid
    rid = engine.add_request(prompt, GREEDY).request_id
    again = engine.run_to_completion()[rid]
    assert again.token_ids == expected and again.metrics.num_cached_tokens == 32


def test_a_failure_that_follows_the_batch_size_ends_with_every_request_served(tiny_llama, check_no_leaks):
    prompts = [_prompt(30, s) for s in range(3)]
    expected = _clean_run(tiny_llama, prompts)
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    failures = _fail_when(engine, lambda reqs: len(reqs) > 2)  # e.g. memory for a big batch only
    ids = [engine.add_request(p, GREEDY).request_id for p in prompts]
    final = engine.run_to_completion()
    assert failures and len(failures) < MAX_STEP_FAILURES
    assert [final[i].token_ids for i in ids] == expected


def test_a_request_in_too_many_failed_batches_fails(tiny_llama, check_no_leaks):
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    _fail_when(engine, lambda reqs: True)
    ids = [engine.add_request(_prompt(10, s), GREEDY).request_id for s in range(3)]
    final = engine.run_to_completion()
    assert all(final[i].finish_reason == "error" for i in ids)


def test_the_async_engine_keeps_serving_after_a_failed_step(tiny_llama):
    async def main():
        async_engine = AsyncLLMEngine(make_engine(tiny_llama))
        _fail_when(async_engine.engine, lambda reqs: any(POISON in r.prompt_token_ids for r in reqs))

        async def run(prompt):
            outs = [o async for o in async_engine.generate(prompt, GREEDY)]
            return outs[-1]

        try:
            bad, good = await asyncio.gather(run([5, POISON, 7]), run(_prompt(20, 1)))
            assert bad.finish_reason == "error" and good.finish_reason == "length"
            assert async_engine.dead_error is None
            later = await run(_prompt(20, 2))
            assert later.finish_reason == "length"
        finally:
            async_engine.shutdown()

    asyncio.run(main())


def test_an_engine_loop_failure_fails_every_waiter_and_later_calls(tiny_llama):
    async def main():
        async_engine = AsyncLLMEngine(make_engine(tiny_llama))

        def broken():
            raise RuntimeError("scheduler bug")

        async_engine.engine.scheduler.schedule = broken
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*[_drain(async_engine, _prompt(10, s)) for s in range(3)],
                               return_exceptions=True), 30
            )
            assert all(isinstance(r, EngineDeadError) for r in results), results
            with pytest.raises(EngineDeadError):
                await _drain(async_engine, _prompt(10, 5))
        finally:
            async_engine.shutdown()

    asyncio.run(main())


async def _drain(async_engine, prompt):
    return [o async for o in async_engine.generate(prompt, GREEDY)]


def test_the_batch_cap_after_a_failure_lasts_until_the_engine_is_idle(tiny_llama, check_no_leaks):
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    failures = _fail_when(engine, lambda reqs: len(reqs) > 2)
    for _ in range(2):  # the second round starts idle: full batches again, so it fails once more
        for s in range(4):
            engine.add_request(_prompt(30, s), GREEDY)
        engine.run_to_completion()
    assert failures == [4, 4]
