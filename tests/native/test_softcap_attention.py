"""Soft-capped scores (Gemma 2: s -> cap * tanh(s / cap) before the softmax) in the native attention
kernels, on every ISA path this CPU runs: decode and prefill against a float64 reference of capped
attention over the same stored rows, with and without a window, f32 and q8_0 keys; and the capped
kernels keep the invariances of the uncapped ones (a sequence alone or batched, a prompt whole or in
chunks: the same bits)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvserve import native
from kvserve.attention import native_paged
from tests.attention.paged_cases import config, filled_storage, prefill_int_keys
from tests.native.softcap_reference import capped_reference, stored_rows

pytestmark = pytest.mark.skipif(native.load("paged_attention") is None,
                                reason="no C compiler on this machine")

CAP, SCALE = 5.0, 0.125
LENS = [1, 17, 255, 256, 257, 333]  # around the 256-position partitions and 16-token blocks


def kernels(storage) -> native_paged.NativePagedAttention:
    return native_paged.NativePagedAttention(storage, native.load("paged_attention"))


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def queries(n: int, cfg, seed: int) -> torch.Tensor:
    """Queries large enough that most scores are well into the cap (|s| up to ~4 cap)."""
    return 4 * torch.randn(n, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(seed))


def assert_near(ours: torch.Tensor, reference: torch.Tensor, int_keys: bool = False) -> None:
    if int_keys:  # the int16 query's rounding (tests/attention/test_native_paged.py), scaled by |q| ~ 4
        assert (ours.double() - reference).abs().max() < 8e-4
    else:
        torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_capped_decode_matches_float64(isa, cache_type, path_build):
    path_build(isa)
    cfg = config(heads=9, kv_heads=3)
    storage, tables = filled_storage(cfg, cache_type, LENS)
    q = queries(len(LENS), cfg, 1)
    rotated = storage.k_codec.rotate(q.double())  # q8_0 keys are stored rotated: score the rotated query
    for layer, window in ((0, None), (1, 100)):
        ours = kernels(storage).decode(layer, q, padded(tables), torch.tensor(LENS), window, SCALE, CAP)
        for i, n in enumerate(LENS):
            keys, values = stored_rows(storage, layer, tables[i], n)
            reference = capped_reference(rotated[i : i + 1], keys, values, torch.tensor([n - 1]), window,
                                         SCALE, CAP)
            assert_near(ours[i : i + 1], reference)
        uncapped = kernels(storage).decode(layer, q, padded(tables), torch.tensor(LENS), window, SCALE)
        assert (uncapped - ours).abs().max() > 1e-2  # the cap changed the result


@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_capped_prefill_matches_float64(isa, cache_type, path_build):
    """A whole prompt and a later chunk (queries from position 200), causal and windowed."""
    path_build(isa)
    cfg = config(heads=9, kv_heads=3)
    storage, tables = filled_storage(cfg, cache_type, [333])
    q = queries(333, cfg, 2)
    int_keys = cache_type == "q8_0" and prefill_int_keys()
    for layer, window in ((0, None), (1, 100)):
        keys, values = stored_rows(storage, layer, tables[0], 333)
        rotated = storage.k_codec.rotate(q.double())  # q8_0 keys are stored rotated
        reference = capped_reference(rotated, keys, values, torch.arange(333), window, SCALE, CAP)
        for start in (0, 200):
            ours = kernels(storage).prefill(layer, q[start:], start, torch.tensor(tables[0]), window, SCALE,
                                            CAP)
            assert_near(ours, reference[start:], int_keys)


@pytest.mark.parametrize("cache_type", ["f32", "q8_0", "q4_0"])
def test_capped_decode_same_bits_alone_and_batched(cache_type):
    cfg = config(heads=9, kv_heads=3)
    lens = [300, 5, 1030, 64]
    storage, tables = filled_storage(cfg, cache_type, lens, seed=3)
    q = queries(len(lens), cfg, 4)
    attention = kernels(storage)
    for window in (None, 70):
        batched = attention.decode(0, q, padded(tables), torch.tensor(lens), window, SCALE, CAP)
        for i, n in enumerate(lens):
            alone = attention.decode(0, q[i : i + 1], padded([tables[i]]), torch.tensor([n]), window, SCALE,
                                     CAP)
            assert torch.equal(alone[0], batched[i]), (i, window)


@pytest.mark.parametrize("cache_type", ["f32", "q8_0", "q4_0"])
def test_capped_prefill_same_bits_whole_or_in_chunks(cache_type):
    """Chunks that cut through query tiles and KV blocks."""
    cfg = config(heads=9, kv_heads=3)
    storage, tables = filled_storage(cfg, cache_type, [531], seed=6)
    q = queries(531, cfg, 7)
    attention, table = kernels(storage), torch.tensor(tables[0])
    for window in (None, 70):
        whole = attention.prefill(0, q, 0, table, window, SCALE, CAP)
        for a, b in itertools.pairwise([0, 5, 37, 256, 300, 531]):
            assert torch.equal(attention.prefill(0, q[a:b], a, table, window, SCALE, CAP), whole[a:b]), (a, b)


def test_no_cap_is_the_uncapped_kernel():
    """softcap None and 0 are the same call: the uncapped arithmetic, bit for bit."""
    cfg = config(heads=9, kv_heads=3)
    storage, tables = filled_storage(cfg, "q8_0", LENS)
    q = queries(len(LENS), cfg, 8)
    attention = kernels(storage)
    args = (0, q, padded(tables), torch.tensor(LENS), None, SCALE)
    assert torch.equal(attention.decode(*args), attention.decode(*args, 0.0))
    chunk = (0, q[:1].expand(40, -1, -1).contiguous(), 293, torch.tensor(tables[-1]), 100, SCALE)
    assert torch.equal(attention.prefill(*chunk), attention.prefill(*chunk, 0.0))
