"""Presets of the architectures beyond llama/gemma3 carry their published config.json values, and
their KV bytes per token follow from them (f16: layers x kv_heads x head_dim x 2 (K and V) x 2 bytes)."""

from __future__ import annotations

import pytest

from kvserve.kv.cache_types import kv_bytes_per_token
from kvserve.models.arch import SUPPORTED_ARCHITECTURES
from kvserve.plan.presets import PRESETS
from tests.plan.helpers import ARCH_PUBLISHED


@pytest.mark.parametrize("name", list(ARCH_PUBLISHED))
def test_preset_matches_published_config(name):
    c = PRESETS[name].config
    got = (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
           c.head_dim, c.vocab_size, c.max_position_embeddings, c.sliding_window, c.rope_theta, c.num_experts,
           c.num_experts_per_tok, kv_bytes_per_token(c, "f16", "f16"))
    assert got == ARCH_PUBLISHED[name]
    assert c.architecture in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize("name, published", [
    ("Qwen3-30B-A3B", 30.5e9), ("Phi-3-mini-4k", 3.82e9), ("Phi-4-mini", 3.84e9), ("Phi-4", 14.7e9),
    ("Gemma-2-2B", 2.61e9), ("Gemma-2-9B", 9.24e9), ("Gemma-2-27B", 27.2e9), ("Granite-3.1-8B", 8.17e9),
    ("OLMoE-1B-7B", 6.92e9),
])
def test_parameter_counts_match_published_sizes(name, published):
    """The model cards' sizes (to their rounding): experts, fused or partial projections counted right."""
    assert PRESETS[name].num_params == pytest.approx(published, rel=0.005)


def test_arch_specific_fields():
    g = PRESETS["Gemma-2-27B"].config
    assert (g.attn_logit_softcap, g.final_logit_softcap, g.attn_scale) == (50.0, 30.0, 144**-0.5)
    assert g.sliding_window_layers[:4] == (True, False, True, False)
    granite = PRESETS["Granite-3.1-8B"].config
    assert (granite.embedding_scale, granite.residual_scale, granite.logits_divisor) == (12.0, 0.22, 16.0)
    assert PRESETS["Phi-4-mini"].config.rotary_dim == 96
    assert not PRESETS["OLMoE-1B-7B"].config.qk_norm_per_head
    assert PRESETS["Qwen3-30B-A3B"].config.norm_topk_prob
