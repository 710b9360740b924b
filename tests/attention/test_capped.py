"""Soft-capped attention (Gemma 2) where no native kernel caps the scores: ``attend(..., softcap=)`` on the
paged backend (the history read back through the storage, every KV type's decoding and rotations) and on
the contiguous one, against a float64 reference of capped attention over the same rows; and a cap that
matters (results far from the uncapped ones), so the check cannot pass by ignoring it."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import native_paged
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.attention.paged import PagedAttention, PagedAttentionMetadata, SequenceSlice, build_decode_batch
from tests.attention.paged_cases import config, filled_storage
from tests.native.softcap_reference import capped_reference, stored_rows

CAP, SCALE = 2.0, 0.5  # scores of |q.k| * 0.5 ~ 10 here: capped at 2 they change the softmax entirely


def reference_of(storage, q, keys, values, positions, window) -> torch.Tensor:
    """capped_reference over the stored rows, in the codec's domain: rotated codecs (tq*) store rotated
    rows, so the query is rotated and the output rotated back, as every attention path does."""
    out = capped_reference(storage.k_codec.rotate(q), keys, values, positions, window, SCALE, CAP)
    return storage.v_codec.unrotate(out.float()).double()


def torch_attention(storage, metadata: PagedAttentionMetadata) -> PagedAttention:
    native_paged._BY_STORAGE[storage] = None  # as on a device without the kernels
    attn = PagedAttention(storage, metadata)
    assert attn.native is None
    attn.write = lambda *args: None  # the k/v are in the storage already
    return attn


@pytest.mark.parametrize("cache_type", ["f32", "q8_0", "tq4"])
def test_paged_capped_prefill_and_decode_match_float64(cache_type):
    cfg = config()
    lens = [40, 300]
    storage, tables = filled_storage(cfg, cache_type, lens, seed=11)
    q = torch.randn(300, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(12)) * 3
    zeros = torch.zeros(300, cfg.num_kv_heads, cfg.head_dim)
    for layer, window in ((0, None), (1, 100)):
        keys, values = stored_rows(storage, layer, tables[1], 300)
        chunk = q[200:]  # a later chunk of the 300-token sequence
        seq = SequenceSlice(0, 100, 300, (torch.tensor(tables[1]),))
        attn = torch_attention(storage, PagedAttentionMetadata((torch.zeros(0, dtype=torch.long),), [seq]))
        ours = attn.attend(layer, chunk, zeros[:100], zeros[:100], window, SCALE, CAP)
        reference = reference_of(storage, chunk, keys, values, torch.arange(200, 300), window)
        torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-4)
        uncapped = attn.attend(layer, chunk, zeros[:100], zeros[:100], window, SCALE)
        assert (uncapped.double() - reference).abs().max() > 0.1  # the cap changed the answer

        batch = build_decode_batch([0, 1], [tables], lens, torch.device("cpu"), 2)
        attn = torch_attention(storage,
                               PagedAttentionMetadata((torch.zeros(0, dtype=torch.long),), [], batch))
        last = torch.stack([q[39], q[299]])
        ours = attn.attend(layer, last, zeros[:2], zeros[:2], window, SCALE, CAP)
        for i, n in enumerate(lens):
            keys, values = stored_rows(storage, layer, tables[i], n)
            reference = reference_of(storage, last[i : i + 1], keys, values, torch.tensor([n - 1]), window)
            torch.testing.assert_close(ours[i : i + 1].double(), reference, rtol=1e-4, atol=1e-4)


def test_contiguous_capped_matches_float64():
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(50, h, 16, generator=g) * 3 for h in (4, 2, 2))
    cache = ContiguousKVCache(1)
    out = torch.cat([cache.attend(0, q[:30], k[:30], v[:30], 20, SCALE, CAP),
                     cache.attend(0, q[30:], k[30:], v[30:], 20, SCALE, CAP)])
    reference = capped_reference(q, k.transpose(0, 1).double(), v.transpose(0, 1).double(), torch.arange(50),
                                 20, SCALE, CAP)
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-4)
