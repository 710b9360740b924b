"""Gemma 3: sliding-window layers, q/k norms, post-norms, GELU, scaled embeddings.

A tiny random Gemma3 (window 8, so the window matters at every prompt here) against transformers,
through the contiguous path and through the paged engine with chunked prefill; and the real
Gemma 3 270M file against the reference path over a prompt longer than its 512-token window."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import load_model
from tests.support import assert_same_or_near_tie, make_engine, reference_greedy

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)  # non-trivial (1 + w) scales
    folder = tmp_path_factory.mktemp("tiny_gemma3")
    model.save_pretrained(folder)
    return model, load_model(str(folder))


def test_config_reads_layer_types(tiny_gemma3):
    hf, ours = tiny_gemma3
    types = hf.config.layer_types
    assert ours.config.sliding_window_layers == tuple(t == "sliding_attention" for t in types)
    assert ours.config.sliding_window == WINDOW
    assert ours.config.architecture == "gemma3"


def test_logits_match_transformers_beyond_the_window(tiny_gemma3):
    hf, ours = tiny_gemma3
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    hidden = ours.model.forward(ids, torch.arange(40), ContiguousKVCache(ours.config.num_layers))
    got = ours.model.compute_logits(hidden)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def test_greedy_matches_transformers(tiny_gemma3):
    hf, ours = tiny_gemma3
    prompt = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    hf.generation_config.eos_token_id = None  # plain greedy: no token is treated specially
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, 20:]
    assert reference_greedy(ours, prompt, 24) == expected.tolist()


def test_paged_engine_with_window_and_chunked_prefill(tiny_gemma3):
    _, ours = tiny_gemma3
    prompts = [
        torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30, 61)]
    engine = make_engine(ours, budget=7, max_num_seqs=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    final = engine.run_to_completion()
    for p, rid in zip(prompts, ids, strict=True):
        assert_same_or_near_tie(ours, p, reference_greedy(ours, p, 20), final[rid].token_ids)


@pytest.mark.slow
def test_real_gemma3_paged_matches_reference_past_the_window():
    """Gemma 3 270M: a 700-token prompt (window 512) through chunked paged prefill and batched decode."""
    loaded = load_model("gemma3-270m")
    assert loaded.config.sliding_window == 512
    from kvserve.quality.text import default_text

    prompt = loaded.tokenizer.encode(default_text()[:4000])[:700]
    expected = reference_greedy(loaded, prompt, 12)
    engine = make_engine(loaded, budget=256, num_ctx=1024, max_num_seqs=2)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).request_id
    other = engine.add_request(prompt[:300], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    final = engine.run_to_completion()
    assert other.request_id in final
    assert_same_or_near_tie(loaded, prompt, expected, final[rid].token_ids)
