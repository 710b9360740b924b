"""KV codecs: stated error bounds, exact bit packing, attention from codes, exact byte accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.attention.ops import sequence_attention
from kvserve.attention.paged import PagedAttention, PagedAttentionMetadata, SequenceSlice, build_decode_batch
from kvserve.config import ModelConfig
from kvserve.kv.cache_types import kv_bytes_per_token as bytes_per_token
from kvserve.kv.codecs import CACHE_TYPES, lloyd_max_codebook, make_codec, pack_bits, unpack_bits
from kvserve.kv.storage import PagedKVStorage

# Relative error |decode(encode(x)) - x| / |x| on Gaussian data, head_dim 64: the bounds we state.
GAUSSIAN_BOUNDS = {"f32": 0.0, "f16": 1e-3, "bf16": 5e-3, "q8_0": 0.01, "fp8": 0.04, "q4_0": 0.12,
                   "tq4": 0.11, "tq3": 0.2, "tq2": 0.36}
BITS = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5, "fp8": 8.25, "tq4": 4.25, "tq3": 3.25,
        "tq2": 2.25}


def relative_error(codec, x):
    y = codec.decode(codec.encode(x), torch.float32)
    return float((codec.unrotate(y) - x).norm() / x.norm())


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_round_trip_within_bound_on_gaussian(name):
    x = torch.randn(256, 3, 64, generator=torch.Generator().manual_seed(0))
    assert relative_error(make_codec(name, 64), x) <= GAUSSIAN_BOUNDS[name]


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_round_trip_with_outlier_channels(name):
    """Real keys have a few large channels; error stays bounded (rotation spreads them out)."""
    x = torch.randn(256, 3, 64, generator=torch.Generator().manual_seed(1))
    x[..., 5] *= 20
    x[..., 40] *= 12
    assert relative_error(make_codec(name, 64), x) <= GAUSSIAN_BOUNDS[name] * 1.5 + 1e-6


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_bits_per_element_are_exact(name):
    codec = make_codec(name, 64)
    assert codec.bits_per_element() == BITS[name]
    assert codec.bytes_per_vector() * 8 == BITS[name] * 64


def test_zero_vectors_stay_zero():
    for name in CACHE_TYPES:
        codec = make_codec(name, 64)
        y = codec.unrotate(codec.decode(codec.encode(torch.zeros(2, 3, 64)), torch.float32))
        assert torch.count_nonzero(y) == 0, name


def test_lloyd_max_levels_match_published_values():
    # Max (1960): 1 bit +-0.7979; 2 bits +-0.4528, +-1.5104; 3 bits outermost +-2.1519
    assert np.allclose(lloyd_max_codebook(1), [-0.7979, 0.7979], atol=1e-4)
    assert np.allclose(lloyd_max_codebook(2), [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    assert abs(float(lloyd_max_codebook(3)[-1]) - 2.1519) < 1e-3


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 5), seed=st.integers(0, 1000))
def test_bit_packing_round_trips_exactly(bits, rows, seed):
    n = 64
    codes = torch.randint(0, 2**bits, (rows, n),
                          generator=torch.Generator().manual_seed(seed)).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (rows, n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def _tiny_config(head_dim=64, kv_heads=2, heads=4, layers=1) -> ModelConfig:
    return ModelConfig("llama", layers, heads * head_dim, 128, heads, kv_heads, head_dim, 100, 4096)


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_attention_from_codes_equals_attention_on_dequantized(name):
    """Paged attention reading codes (rotated domain, batched decode and prefill paths) equals plain
    attention over the decoded K/V."""
    cfg = _tiny_config()
    g = torch.Generator().manual_seed(2)
    storage = PagedKVStorage(cfg, num_blocks=8, block_size=4, cache_type=name, device=torch.device("cpu"))
    n = 13
    q = torch.randn(n, 4, 64, generator=g)
    k = torch.randn(n, 2, 64, generator=g)
    v = torch.randn(n, 2, 64, generator=g)
    table = torch.tensor([5, 1, 6, 2])
    slots = torch.tensor([int(table[p // 4]) * 4 + p % 4 for p in range(n)])
    # prefill of 12 tokens, then one decode token
    pre = PagedAttentionMetadata((slots[:12],), [SequenceSlice(0, 12, 12, (table[:3],))])
    out_pre = PagedAttention(storage, pre).attend(0, q[:12], k[:12], v[:12], None, 0.125)
    dec = PagedAttentionMetadata((slots[12:],), [],
                                 build_decode_batch([0], [[table.tolist()]], [13], torch.device("cpu")))
    out_dec = PagedAttention(storage, dec).attend(0, q[12:], k[12:], v[12:], None, 0.125)
    codec_k, codec_v = storage.k_codec, storage.v_codec
    kd = codec_k.unrotate(codec_k.decode(codec_k.encode(k), torch.float32))
    vd = codec_v.unrotate(codec_v.decode(codec_v.encode(v), torch.float32))
    ref = sequence_attention(q, kd.transpose(0, 1), vd.transpose(0, 1), 0, None, 0.125)
    # prefill scores q8_0/q4_0 keys against the query rounded to int16 (see
    # tests/attention/test_native_paged.py)
    prefill_atol = 2e-4 if name in ("q8_0", "q4_0") else 1e-5
    assert torch.allclose(out_pre, ref[:12], atol=prefill_atol, rtol=1e-4)
    assert torch.allclose(out_dec, ref[12:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("k_type", CACHE_TYPES)
@pytest.mark.parametrize("v_type", ["f16", "q4_0", "tq3"])
def test_storage_bytes_match_the_formula(k_type, v_type):
    """SmolLM2's shape: 30 layers, 3 KV heads, head_dim 64. Allocated bytes = blocks x block size x
    bytes/token, and bytes/token = layers x kv_heads x head_dim x (bits_k + bits_v) / 8."""
    cfg = ModelConfig("llama", 30, 576, 1536, 9, 3, 64, 49152, 8192)
    per_token = bytes_per_token(cfg, k_type, v_type)
    assert per_token == 30 * 3 * 64 * (BITS[k_type] + BITS[v_type]) / 8
    if k_type == v_type:
        assert per_token == 2 * 30 * 3 * 64 * BITS[k_type] / 8
    storage = PagedKVStorage(cfg, 5, 16, k_type, torch.device("cpu"), v_type)
    assert storage.nbytes == 5 * 16 * per_token


def test_unsupported_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="power-of-two"):
        make_codec("tq3", 96)
    with pytest.raises(ValueError, match="divisible by 32"):
        make_codec("q8_0", 80)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        make_codec("q3_k", 64)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotated_decode_reads_the_codes_pack_bits_wrote(bits):
    """The fast table / word unpacking of the rotated codecs against the bit-plane reference."""
    from kvserve.kv.codecs import RotatedCodec

    codec = RotatedCodec(64, bits)
    codes = torch.randint(0, 2**bits, (5, 3, 64), generator=torch.Generator().manual_seed(bits),
                          dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert torch.equal(unpack_bits(packed, bits, 64), codes)
    assert torch.equal(codec._values(packed, torch.float32), torch.from_numpy(codec.codebook)[codes.long()])


def test_nibble_unpacking_equals_bit_unpacking():
    from kvserve.kv.codecs import unpack_nibbles

    codes = torch.randint(0, 16, (7, 2, 64), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    packed = pack_bits(codes, 4)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_the_tables_the_kernels_take_are_torchs():
    """What the CPU runtime computes without torch is what torch computed when the formats were set: the
    rotation's signs (``SIGN_BITS``, drawn by torch's generator), the Lloyd-Max levels (numpy's erf and exp
    against torch.distributions), the e4m3 code values (against torch's float8 type)."""
    import math

    from kvserve.kv.codecs import SIGN_BITS, FP8Codec, hadamard_signs

    for head_dim in SIGN_BITS:
        drawn = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(0x5EED + head_dim))
        assert np.array_equal(hadamard_signs(head_dim), drawn.float().numpy() * 2 - 1)
    normal = torch.distributions.Normal(0.0, 1.0)
    for bits in (1, 2, 3, 4):
        levels = torch.linspace(-2.5, 2.5, 2**bits, dtype=torch.float64) * (1 if bits > 1 else 0.4)
        for _ in range(200):
            edges = torch.cat([torch.tensor([-math.inf]), (levels[1:] + levels[:-1]) / 2,
                               torch.tensor([math.inf])])
            pdf = torch.exp(normal.log_prob(edges)).nan_to_num(0.0)
            levels = (pdf[:-1] - pdf[1:]) / (normal.cdf(edges)[1:] - normal.cdf(edges)[:-1]).clamp_min(1e-30)
        assert np.array_equal(lloyd_max_codebook(bits), levels.float().numpy())
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(FP8Codec(64).code_table(), e4m3, equal_nan=True)
