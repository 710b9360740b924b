"""Every architecture beyond llama/qwen2/gemma3 (qwen3, mistral, phi3, gemma2, granite, qwen3moe, olmoe)
against transformers: a tiny random model (``arch_builders``) loaded from its HF folder and from its
GGUF file; last-position logits within 1e-4 of transformers' on three prompts and 32 greedy tokens
identical, through both loaders; then through the paged engine (chunked prefill, batching, prefix
caching) with quantized KV types."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import load_model
from tests.models import arch_builders as ab
from tests.models.hf_reference import (
    LOGITS_RTOL,
    NEW_TOKENS,
    hf_greedy,
    hf_last_logits,
    our_greedy,
    our_last_logits,
    rel_err,
)
from tests.support import NEAR_TIE, assert_same_or_near_tie, make_engine, reference_greedy


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, ab.VOCAB, (n,), generator=g).tolist() for n in (1, 9, 40)]


@pytest.fixture(scope="module", params=list(ab.SPECS))
def built(request, tmp_path_factory):
    """(name, transformers model, our model from the folder, our model from the GGUF, HF reference)."""
    name = request.param
    hf = ab.build_hf_model(name)
    folder = tmp_path_factory.mktemp(f"hf-{name}")
    hf.save_pretrained(str(folder))
    path = ab.write_gguf(tmp_path_factory.mktemp(f"gguf-{name}") / f"{name}.gguf", hf, name)
    ps = prompts()
    ref = ps, [hf_last_logits(hf, p) for p in ps], [hf_greedy(hf, p, NEW_TOKENS) for p in ps]
    return name, hf, load_model(str(folder), device="cpu"), load_model(str(path), device="cpu"), ref


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_logits_and_greedy_match_transformers(built, source):
    name, _, folder, gguf_model, (ps, ref_logits, ref_tokens) = built
    ours = folder if source == "folder" else gguf_model
    assert ours.config.architecture == ab.SPECS[name]["arch"]
    errs = [rel_err(our_last_logits(ours, p), ref) for p, ref in zip(ps, ref_logits, strict=True)]
    print(f"{name} {source}: max rel err per prompt {errs}")
    assert max(errs) < LOGITS_RTOL, errs
    for p, ref in zip(ps, ref_tokens, strict=True):
        assert our_greedy(ours, p, NEW_TOKENS) == ref, f"prompt {p}"


def test_folder_and_gguf_configs_agree(built):
    """What both loaders read (multipliers, softcaps, windows, rotary dims, experts) is the same config."""
    _, _, folder, gguf_model, _ = built
    a, b = folder.config, gguf_model.config
    skip = {"name", "max_position_embeddings", "tie_word_embeddings", "rope_scaling"}
    differ = {f: (getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__ if f not in skip
              and getattr(a, f) != pytest.approx(getattr(b, f))}
    assert not differ, differ


def _run(engine, ps, params):
    ids = [engine.add_request(p, params).request_id for p in ps]
    final = engine.run_to_completion()
    return [final[i] for i in ids]


def _assert_matches(reference, outputs):
    """Same tokens, or the first difference is a near-tie in the reference run's own logprobs."""
    for ref, out in zip(reference, outputs, strict=True):
        if ref.token_ids != out.token_ids:
            i = next(j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=False)) if a != b)
            top = ref.logprobs[i].top
            assert top[0][2] - top[1][2] < NEAR_TIE, (i, ref.token_ids, out.token_ids)


@pytest.mark.parametrize("cache_type", ["f32", "q8_0", "tq4"])
def test_paged_engine_in_every_mode(built, cache_type):
    """Chunked prefill, three sequences batched, and a shared prefix served from the cache give the tokens
    each prompt gets alone with the same KV type (f32: the contiguous reference path's)."""
    _, _, _, ours, _ = built
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, ab.VOCAB, (33,), generator=g).tolist()
    ps = [prefix + torch.randint(0, ab.VOCAB, (n,), generator=g).tolist() for n in (3, 20)] + [prefix[:7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = make_engine(ours, max_num_seqs=1, prefix_caching=False, block_size=8, cache_type_k=cache_type)
    reference = [_run(alone, [p], params)[0] for p in ps]
    if cache_type == "f32":
        for p, ref in zip(ps, reference, strict=True):
            assert_same_or_near_tie(ours, p, reference_greedy(ours, p, 12), ref.token_ids)
    engine = make_engine(ours, budget=16, max_num_seqs=3, block_size=8, cache_type_k=cache_type)
    _assert_matches(reference, _run(engine, ps, params))
    again = _run(engine, ps[1:2], params)[0]  # its prefix blocks are cached now
    assert again.metrics.num_cached_tokens > 0
    _assert_matches(reference[1:2], [again])


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """phi3-longrope (original context 128, 512 in all): transformers' model, ours from the folder and
    from the GGUF (the factors as rope_factors_short/long.weight tensors)."""
    hf = ab.build_hf_model("phi3-longrope")
    folder = tmp_path_factory.mktemp("hf-longrope")
    hf.save_pretrained(str(folder))
    path = ab.write_gguf(tmp_path_factory.mktemp("gguf-longrope") / "longrope.gguf", hf, "phi3-longrope")
    return hf, {"folder": load_model(str(folder), device="cpu"), "gguf": load_model(str(path), device="cpu")}


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_longrope_past_the_original_context(longrope, source):
    """A 200-token prompt, past the original 128: transformers rotates the whole sequence with the long
    factors, as we do once set up for a longer context (whole prefill, chunked prefill, greedy decode);
    on the short factors the logits are far off. Set back up for the original context, a short prompt
    matches on the short factors again."""
    hf, models = longrope
    ours = models[source]
    rope, original = ours.model.rope, ours.config.rope_scaling.original_max_position_embeddings
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, ab.VOCAB, (200,), generator=g).tolist()
    ref = hf_last_logits(hf, prompt)
    on_short = rel_err(our_last_logits(ours, prompt), ref)
    rope.fit_context(ab.CONTEXT)
    try:
        errs = [rel_err(our_last_logits(ours, prompt), ref),
                rel_err(our_last_logits(ours, prompt, [100, 60, 40]), ref)]
        greedy = our_greedy(ours, prompt, 8)
    finally:
        rope.fit_context(original)
    print(f"longrope {source}: rel err {errs}, on the short factors {on_short}")
    assert max(errs) < LOGITS_RTOL, errs
    assert on_short > 100 * LOGITS_RTOL
    assert greedy == hf_greedy(hf, prompt, 8)
    short_prompt = prompt[:40]
    assert rel_err(our_last_logits(ours, short_prompt), hf_last_logits(hf, short_prompt)) < LOGITS_RTOL


def test_the_engine_serves_longrope_on_the_factors_of_its_context(longrope):
    """An engine whose context is longer than the original serves on the long factors (a 200-token prompt
    answers as transformers does), one within it on the short ones, alternating on one shared model; the
    factor set is part of the cache identity, so their blocks never mix."""
    hf, models = longrope
    ours = models["gguf"]
    prompt = torch.randint(0, ab.VOCAB, (200,), generator=torch.Generator().manual_seed(12)).tolist()
    long_engine, short_engine = make_engine(ours, num_ctx=ab.CONTEXT), make_engine(ours, num_ctx=128)
    assert long_engine.cache_identity["rope_factors"] == "long"
    assert short_engine.cache_identity["rope_factors"] == "short"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    short_prompt = prompt[:40]
    for _ in range(2):  # alternating: each engine puts the model back on its own factors
        rid = long_engine.add_request(prompt, params).request_id
        assert long_engine.run_to_completion()[rid].token_ids == hf_greedy(hf, prompt, 8)
        rid = short_engine.add_request(short_prompt, params).request_id
        assert short_engine.run_to_completion()[rid].token_ids == hf_greedy(hf, short_prompt, 8)
