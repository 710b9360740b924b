"""Presets carry the values of the published Hugging Face config.json files."""

from __future__ import annotations

import pytest

from kvserve.plan.presets import PRESETS, find_preset, num_params

# name: (layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, max_position_embeddings,
#        sliding_window, rope_theta, tied embeddings) as published
PUBLISHED = {
    "Llama-3.1-8B": (32, 4096, 14336, 32, 8, 128, 128256, 131072, None, 500000.0, False),
    "Llama-3.1-70B": (80, 8192, 28672, 64, 8, 128, 128256, 131072, None, 500000.0, False),
    "Qwen3-8B": (36, 4096, 12288, 32, 8, 128, 151936, 40960, None, 1000000.0, False),
    "Mistral-7B": (32, 4096, 14336, 32, 8, 128, 32000, 32768, 4096, 10000.0, False),
    "Gemma-3-1B": (26, 1152, 6912, 4, 1, 256, 262144, 32768, 512, 1000000.0, True),
    "Gemma-3-4B": (34, 2560, 10240, 8, 4, 256, 262208, 131072, 1024, 1000000.0, True),
    "Gemma-3-12B": (48, 3840, 15360, 16, 8, 256, 262208, 131072, 1024, 1000000.0, True),
    "Gemma-3-27B": (62, 5376, 21504, 32, 16, 128, 262208, 131072, 1024, 1000000.0, True),
}


def test_every_preset_is_checked():
    from tests.plan.helpers import ARCH_PUBLISHED

    assert set(PRESETS) == set(PUBLISHED) | set(ARCH_PUBLISHED)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_matches_published_config(name):
    c = PRESETS[name].config
    got = (
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.max_position_embeddings,
        c.sliding_window,
        c.rope_theta,
        c.tie_word_embeddings,
    )
    assert got == PUBLISHED[name]


def test_llama31_rope_scaling():
    for name in ("Llama-3.1-8B", "Llama-3.1-70B"):
        rs = PRESETS[name].config.rope_scaling
        assert (
            rs.rope_type,
            rs.factor,
            rs.low_freq_factor,
            rs.high_freq_factor,
            rs.original_max_position_embeddings,
        ) == ("llama3", 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("name", [n for n in PUBLISHED if n.startswith("Gemma")])
def test_gemma3_has_five_local_layers_per_global_one(name):
    c = PRESETS[name].config
    pattern = c.sliding_window_layers
    assert len(pattern) == c.num_layers
    assert [i for i, sliding in enumerate(pattern) if not sliding] == list(range(5, c.num_layers, 6))
    assert c.rope_theta_local == 10000.0 and c.qk_norm and c.post_norms
    # query_pre_attn_scalar: head_dim, except 27B's hidden / heads = 168
    assert c.attn_scale == pytest.approx((168 if name == "Gemma-3-27B" else 256) ** -0.5)
    assert c.rope_scaling.factor == (1.0 if name == "Gemma-3-1B" else 8.0)


def test_mistral_v01_slides_in_every_layer():
    c = PRESETS["Mistral-7B"].config
    assert c.sliding_window == 4096 and all(c.sliding_window_layers) and len(c.sliding_window_layers) == 32


@pytest.mark.parametrize(
    "name, published",
    [
        ("Llama-3.1-8B", 8_030_261_248),
        ("Llama-3.1-70B", 70_553_706_496),
        ("Mistral-7B", 7_241_732_096),
        ("Gemma-3-1B", 999_885_952),
        ("Qwen3-8B", 8_190_735_360),
    ],
)
def test_parameter_count_formula_matches_published_counts(name, published):
    assert num_params(PRESETS[name].config) == published == PRESETS[name].num_params


def test_find_preset_ignores_case_and_punctuation():
    assert find_preset("llama-3.1-8b").name == "Llama-3.1-8B"
    assert find_preset("gemma3-4b").name == "Gemma-3-4B"
    assert find_preset("Mistral-7B-v0.1").name == "Mistral-7B"
    assert find_preset("llama-3.1-9b") is None
