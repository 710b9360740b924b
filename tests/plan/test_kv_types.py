"""The KV type table: bits per element by formula, exact bytes per head-vector and per token."""

from __future__ import annotations

import pytest

from kvserve.kv import codecs
from kvserve.kv.cache_types import KV_TYPES, kv_bytes_per_token, kv_type
from tests.plan.helpers import llama

# name -> bits per element as a function of head_dim D, written out from the formulas
FORMULAS = {
    "f32": lambda d: 32,
    "f16": lambda d: 16,
    "bf16": lambda d: 16,
    "q8_0": lambda d: 8 + 16 / 32,  # 32 int8 codes + one f16 scale per 32 elements
    "q4_0": lambda d: 4 + 16 / 32,
    "fp8": lambda d: 8 + 16 / d,  # e4m3 codes + one f16 scale per head-vector
    "tq4": lambda d: 4 + 16 / d,  # b-bit codes + one f16 norm per head-vector
    "tq3": lambda d: 3 + 16 / d,
    "tq2": lambda d: 2 + 16 / d,
}


def test_the_table_has_exactly_the_planned_types():
    assert list(KV_TYPES) == list(FORMULAS)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", list(FORMULAS))
def test_bits_per_element_follow_the_formula(name, head_dim):
    t = kv_type(name)
    assert t.bits_per_element(head_dim) == FORMULAS[name](head_dim)
    assert t.bytes_per_vector(head_dim) * 8 == FORMULAS[name](head_dim) * head_dim


def test_quantized_types_at_head_dim_128():
    bytes_per_vector = {n: kv_type(n).bytes_per_vector(128) for n in KV_TYPES}
    assert bytes_per_vector == {
        "f32": 512,
        "f16": 256,
        "bf16": 256,
        "q8_0": 136,
        "q4_0": 72,
        "fp8": 130,
        "tq4": 66,
        "tq3": 50,
        "tq2": 34,
    }


def test_kv_bytes_per_token_is_2_x_layers_x_kv_heads_x_head_dim_x_bits_over_8():
    config = llama(num_layers=32, num_kv_heads=8)
    for name in KV_TYPES:
        bits = kv_type(name).bits_per_element(128)
        assert kv_bytes_per_token(config, name) == 2 * 32 * 8 * 128 * bits / 8


def test_different_k_and_v_types_sum_each_half():
    config = llama(num_layers=32, num_kv_heads=8)
    assert kv_bytes_per_token(config, "q8_0", "q4_0") == 32 * 8 * (136 + 72)
    assert (
        kv_bytes_per_token(config, "q8_0", "q4_0")
        == (kv_bytes_per_token(config, "q8_0") + kv_bytes_per_token(config, "q4_0")) // 2
    )


def test_unknown_type_and_impossible_head_dims_are_value_errors():
    with pytest.raises(ValueError, match="unknown KV cache type 'q5_1'"):
        kv_type("q5_1")
    with pytest.raises(ValueError, match="divisible by 32"):
        kv_type("q8_0").bytes_per_vector(48)
    with pytest.raises(ValueError, match="power-of-two"):
        kv_type("tq3").bytes_per_vector(96)
    assert kv_type("fp8").bytes_per_vector(96) == 96 + 2  # no such constraint on fp8


def test_the_engine_codecs_store_what_the_table_says():
    assert set(codecs.CACHE_TYPES) == set(KV_TYPES)
    for name in codecs.CACHE_TYPES:
        for head_dim in (64, 128, 256):
            assert codecs.make_codec(name, head_dim).bytes_per_vector() == kv_type(name).bytes_per_vector(
                head_dim
            )


def test_a_pair_name_counts_its_keys_and_its_values():
    config = llama(8, 128)
    assert kv_bytes_per_token(config, "q4_0/tq2") == kv_bytes_per_token(config, "q4_0", "tq2")
    assert kv_bytes_per_token(config, "q4_0/tq2") < kv_bytes_per_token(config, "q4_0")
    with pytest.raises(ValueError, match="unknown KV cache type 'q3'"):
        kv_bytes_per_token(config, "q4_0/q3")
