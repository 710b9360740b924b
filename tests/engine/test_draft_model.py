"""Speculative decoding with a draft model (``engine/draft_model.py``): the same token ids and logprobs
with the draft on and off (greedy and seeded sampling, several requests at once), guesses kept when
the draft is the model itself, nothing changed by a draft that guesses badly, the draft's cache cut
back after rejections, and a draft with another tokenizer refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvserve.config import SpeculativeConfig
from kvserve.engine.draft_model import DraftKVCache, DraftModelProposer
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import load_model
from tests.support import make_engine, write_tiny_llama


def _with_draft(engine, draft: str, k: int = 4) -> LLMEngine:
    return LLMEngine(replace(engine.config, speculative=SpeculativeConfig("draft", k, draft_model=draft)),
                     engine.loaded)


def _run(engine, prompts, params):
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = engine.run_to_completion()
    return [(done[i].token_ids, [lp.logprob for lp in done[i].logprobs or []]) for i in ids]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=0),
], ids=["greedy", "seeded-sampling"])
def test_the_model_as_its_own_draft_changes_nothing_and_is_kept(smollm2_q4, check_no_leaks, params):
    tok = smollm2_q4.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": "Name three colours."}]),
               tok.encode("The capital of France is")]
    expected = _run(make_engine(smollm2_q4, max_num_seqs=4), prompts, params)
    engine = _with_draft(make_engine(smollm2_q4, max_num_seqs=4), str(smollm2_q4.path))
    check_no_leaks.append(engine)
    assert _run(engine, prompts, params) == expected
    assert engine.num_draft_tokens > 0
    if params.temperature == 0:  # the draft's greedy guesses are the model's own: nearly all kept
        assert engine.num_accepted_tokens >= 0.8 * engine.num_draft_tokens


def test_a_draft_that_guesses_badly_changes_nothing(tmp_path, check_no_leaks):
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    target = load_model(str(write_tiny_llama(tmp_path / "target", seed=3)))
    draft_dir = write_tiny_llama(tmp_path / "draft", seed=4, layers=1)  # same vocabulary, other weights
    prompts = [[5, 17, 33, 2, 8], [40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    expected = _run(make_engine(target, max_num_seqs=2), prompts, params)
    engine = _with_draft(make_engine(target, max_num_seqs=2), str(draft_dir), k=3)
    check_no_leaks.append(engine)
    got = _run(engine, prompts, params)
    # f32 weights through torch's matmul: a row's logits move with the rows beside it (~1e-6), so the
    # logprobs within that, the tokens the same
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    for (_, lp), (_, lp_ref) in zip(got, expected, strict=True):
        assert torch.allclose(torch.tensor(lp), torch.tensor(lp_ref), atol=1e-4)
    assert engine.num_draft_tokens > engine.num_accepted_tokens  # some guesses were rejected and rolled back


def test_the_draft_cache_is_cut_back_to_what_the_request_shares(tiny_llama):
    proposer = DraftModelProposer(SpeculativeConfig("draft", 3, draft_model="x"), tiny_llama)
    first = proposer.propose("r", [1, 2, 3, 4], limit=3)
    assert len(first) == 3
    state = proposer._states["r"]
    assert state.tokens == [1, 2, 3, 4, *first[:2]] and state.cache.length == 6
    # the target kept the first guess and sampled another token: the cache drops the rejected guess
    tokens = [1, 2, 3, 4, first[0], (first[1] + 1) % 90 + 3]
    again = proposer.propose("r", tokens, limit=2)
    fresh = DraftModelProposer(SpeculativeConfig("draft", 3, draft_model="x"), tiny_llama)
    assert again == fresh.propose("s", tokens, limit=2)  # the same guesses as reading the tokens anew
    proposer.forget("r")
    assert "r" not in proposer._states


def test_the_dense_cache_grows_and_truncates():
    cache = DraftKVCache(1)
    q = torch.randn(3, 2, 8)
    k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    cache.attend(0, q, k, v, None, 0.3)
    cache.truncate(1)
    cache.attend(0, q[:2], k[1:], v[1:], None, 0.3)
    assert cache.length == 3 and torch.equal(cache.keys[0][:3], k)


def test_a_draft_with_another_vocabulary_is_refused(smollm2_q4, tiny_llama):
    with pytest.raises(ValueError, match="vocabulary"):
        _with_draft(make_engine(smollm2_q4), str(tiny_llama.path))
    for bad in ({"method": "draft"}, {"method": "ngram", "draft_model": "x"}):
        with pytest.raises(ValueError, match="draft"):
            SpeculativeConfig(**bad)
