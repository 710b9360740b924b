"""Sampling filters and penalties on hand-made logits (no model)."""

from __future__ import annotations

import math

import numpy as np

from kvserve.engine.constraints import GrammarError
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, apply_penalties, filter_logits
from kvserve.engine.sampling_params import SamplingParams

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))


def kept(x: np.ndarray) -> list[int]:
    return [i for i, v in enumerate(x.tolist()) if v != -math.inf]


def test_top_k_keeps_the_k_largest():
    assert kept(filter_logits(LOGITS.copy(), 2, 1.0, 0.0)) == [0, 1]
    assert kept(filter_logits(LOGITS.copy(), 0, 1.0, 0.0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(filter_logits(LOGITS.copy(), 0, 0.5, 0.0)) == [0]  # 0.5 alone reaches 0.5
    assert kept(filter_logits(LOGITS.copy(), 0, 0.7, 0.0)) == [0, 1]  # 0.75 >= 0.7
    assert kept(filter_logits(LOGITS.copy(), 0, 0.8, 0.0)) == [0, 1, 2]


def test_min_p_is_relative_to_the_top_probability():
    assert kept(filter_logits(LOGITS.copy(), 0, 1.0, 0.3)) == [0, 1, 2]  # >= 0.15
    assert kept(filter_logits(LOGITS.copy(), 0, 1.0, 0.6)) == [0]


def _request(output: list[int], **params) -> Request:
    r = Request("r", [0, 1], SamplingParams(**params), max_total_tokens=100)
    for t in output:
        r.append_token(t)
    return r


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 1.0, 4.0], dtype=np.float32)
    out = apply_penalties(logits.copy(), _request([3], repetition_penalty=2.0))  # seen: 0, 1 (prompt), 3
    assert out.tolist() == [1.0, -4.0, 1.0, 2.0]


def test_presence_and_frequency_penalties_use_output_counts():
    logits = np.zeros(4, dtype=np.float32)
    out = apply_penalties(logits.copy(), _request([2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25))
    assert out.tolist() == [0.0, 0.0, -1.0, -0.75]


def test_greedy_takes_the_argmax_even_with_filters():
    s = Sampler(str)
    r = _request([], temperature=0, top_k=1)
    assert s.sample(np.array([[0.1, 3.0, 2.0]]), [r])[0][0] == 1


def test_a_batch_takes_each_greedy_rows_argmax_and_leaves_the_others_to_their_own_rules():
    s = Sampler(str)
    logits = np.array([[0.1, 3.0, 2.0, 3.0],   # a tie: the first maximum, as alone
                           [5.0, 1.0, 0.0, 0.0],
                           [0.0, 0.0, 9.0, 5.0],   # the penalty cuts token 2's logit to 0.9: token 3
                           [0.0, 0.0, 0.0, 7.0]])
    requests = [_request([], temperature=0), _request([], temperature=0),
                _request([2], temperature=0, repetition_penalty=10.0), _request([], temperature=0)]
    batched = [token for token, _ in s.sample(logits, requests)]
    assert batched == [1, 0, 3, 3]
    assert batched == [s.sample(row[None], [r])[0][0] for row, r in zip(logits, requests, strict=True)]


def test_seeded_draws_follow_the_distribution():
    s = Sampler(str)
    counts = [0, 0, 0]
    r = _request([], temperature=1.0, seed=7)
    for _ in range(3000):
        counts[s.sample(np.log(np.array([[0.6, 0.3, 0.1]], dtype=np.float32)), [r])[0][0]] += 1
    assert abs(counts[0] / 3000 - 0.6) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03
    r2 = _request([], temperature=1.0, seed=7)
    logits = np.log(np.array([[0.6, 0.3, 0.1]], dtype=np.float32))
    again = [s.sample(logits, [r2])[0][0] for _ in range(50)]
    r3 = _request([], temperature=1.0, seed=7)
    assert again == [s.sample(logits, [r3])[0][0] for _ in range(50)]


def test_extreme_in_range_values_draw_a_token_instead_of_failing():
    """Values the API accepts must never reach the draw as inf/NaN probabilities."""
    s = Sampler(str)
    logits = np.array([[2.0, 5.0, -1.0, 0.0]])
    cases = {
        "tiny temperature is greedy": {"temperature": 1e-39},
        "top_p that is 0 in float32 keeps the top token": {"temperature": 1.0, "top_p": 1e-46},
        "tiny repetition penalty": {"temperature": 1.0, "repetition_penalty": 1e-300},
        "huge repetition penalty": {"temperature": 1.0, "repetition_penalty": 1e300},
        "huge temperature": {"temperature": 1e38},
    }
    for name, params in cases.items():
        [(token, _)] = s.sample(logits.copy(), [_request([1, 0], seed=3, **params)])
        assert isinstance(token, int), f"{name}: {token!r}"
    [(token, _)] = s.sample(logits.copy(), [_request([], temperature=1e-39, seed=1)])
    assert token == 1  # greedy: the argmax
    [(token, _)] = s.sample(logits.copy(), [_request([], temperature=1.0, top_p=1e-46, seed=1)])
    assert token == 1  # only the most likely token is left
    # seen tokens 0 and 1 boosted to +inf by a tiny penalty: the draw stays among them
    drawn = {s.sample(logits.copy(),
                      [_request([0, 1], temperature=1.0, repetition_penalty=1e-300, seed=i)])[0][0]
             for i in range(20)}
    assert drawn <= {0, 1}


def test_top_p_on_a_large_vocabulary_keeps_what_a_full_sort_keeps():
    """The cut sorts only the largest entries it needs; a full sort of every probability says the same."""
    rng = np.random.default_rng(0)
    for scale, top_p in [(1.0, 0.9), (4.0, 0.5), (0.2, 0.99), (8.0, 0.999), (1.0, 1e-9)]:
        logits = (rng.standard_normal(151_936) * scale).astype(np.float32)
        probs = np.exp(logits.astype(np.float64) - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        want = sorted(order[: max(1, int((before < top_p).sum()))].tolist())
        assert kept(filter_logits(logits, 0, top_p, 0.0)) == want, (scale, top_p)


def test_a_negative_seed_is_its_value_modulo_2_to_the_64():
    """The APIs take seeds from -2**63: one draws as its value modulo 2**64 does."""
    s = Sampler(str)
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], dtype=np.float32))
    negative, wrapped = _request([], temperature=1.0, seed=-5), _request([], temperature=1.0, seed=2**64 - 5)
    drawn = [s.sample(logits, [negative])[0][0] for _ in range(40)]
    assert all(isinstance(t, int) for t in drawn)
    assert drawn == [s.sample(logits, [wrapped])[0][0] for _ in range(40)]


def test_a_repeated_logit_bias_id_takes_its_last_value():
    logits = np.zeros(4, dtype=np.float32)
    out = apply_penalties(logits, _request([], logit_bias=((2, 10.0), (2, 30.0))))
    assert out.tolist() == [0.0, 0.0, 30.0, 0.0]


def test_a_grammar_that_allows_no_token_ends_its_request_as_a_grammar_error():
    """Every token masked: the request's error is the grammar's (a 400 when it ends), not a draw."""

    class NothingAllowed:
        def forbidden(self, vocab: int) -> np.ndarray:
            return np.ones(vocab, dtype=bool)

        def advance(self, token: int) -> None:
            raise AssertionError("no token may be drawn")

    s = Sampler(str)
    r = _request([], temperature=1.0, seed=1)
    r.constraint = NothingAllowed()
    [(error, _)] = s.sample(np.zeros((1, 5), dtype=np.float32), [r])
    assert isinstance(error, GrammarError)
