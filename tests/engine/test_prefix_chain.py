"""A prefix-cache hit must match the whole chain of blocks before it. With a hash that collides on
purpose (it ignores the parent and the salt, as a weak or attacked hash would), the engine still
serves no K/V computed under another prefix."""

from __future__ import annotations

import random

from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv import hashing
from tests.support import make_engine

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _block(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(BS)]


def _run(engine, prompt):
    rid = engine.add_request(prompt, GREEDY).request_id
    return engine.run_to_completion()[rid]


def test_colliding_hashes_do_not_serve_kv_of_another_prefix(tiny_llama, check_no_leaks, monkeypatch):
    x, y, a = _block(1), _block(2), _block(3)
    tail = [7]
    expected = _run(make_engine(tiny_llama, prefix_caching=False), y + a + tail)

    monkeypatch.setattr(hashing, "hash_block", lambda parent, token_ids, salt=None, key=None: hash(token_ids))
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    _run(engine, y + tail)  # caches block Y
    _run(engine, x + a + tail)  # caches X, and A computed after X: A's hash is the same after any block
    out = _run(engine, y + a + tail)
    assert out.metrics.num_cached_tokens == BS  # Y only: the cached A follows X, not Y
    assert out.token_ids == expected.token_ids
    again = _run(engine, y + a + tail)  # now A after Y is computed and cached too... under the same hash
    assert again.token_ids == expected.token_ids


def test_salted_requests_do_not_share_blocks_even_when_hashes_collide(tiny_llama, check_no_leaks,
                                                                      monkeypatch):
    monkeypatch.setattr(hashing, "hash_block", lambda parent, token_ids, salt=None, key=None: hash(token_ids))
    engine = make_engine(tiny_llama)
    check_no_leaks.append(engine)
    prompt = _block(4) + _block(5) + [9]
    rid = engine.add_request(prompt, GREEDY, cache_salt="alice").request_id
    engine.run_to_completion()
    rid = engine.add_request(prompt, GREEDY, cache_salt="bob").request_id
    assert engine.run_to_completion()[rid].metrics.num_cached_tokens == 0
    rid = engine.add_request(prompt, GREEDY, cache_salt="alice").request_id
    assert engine.run_to_completion()[rid].metrics.num_cached_tokens == 2 * BS
