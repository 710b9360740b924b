"""Paged KV storages filled with known rows and the calls that attend over them, for the kernel tests of
every instruction-set path."""

from __future__ import annotations

import torch

from kvserve import native
from kvserve.attention import native_paged
from kvserve.attention.paged import PagedAttention, PagedAttentionMetadata, SequenceSlice, build_decode_batch
from kvserve.config import ModelConfig
from kvserve.kv.storage import PagedKVStorage

BLOCK = 16
NUM_BLOCKS = 96


def prefill_int_keys() -> bool:
    """Whether the paged_attention build loaded now (the path a test selected) scores q8_0/q4_0 keys in
    integers in prefill (AVX-512 VNNI): the int16 query then moves outputs by up to ~1e-4."""
    library = native.load("paged_attention")
    return bool(library and library.paged_prefill_int_keys())


def config(heads=6, kv_heads=2, head_dim=64) -> ModelConfig:
    return ModelConfig(architecture="llama", num_layers=2, hidden_size=heads * head_dim, intermediate_size=8,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=8,
                       max_position_embeddings=4096)


def filled_storage(cfg, cache_type, context_lens, seed=0, block=BLOCK):
    """Storage with random k/v written for sequences of the given lengths; their shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    storage = PagedKVStorage(cfg, NUM_BLOCKS, block, cache_type, torch.device("cpu"))
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = []
    for n in context_lens:
        table = [free.pop() for _ in range(-(-n // block))]
        tables.append(table)
        slots = torch.tensor([table[t // block] * block + t % block for t in range(n)])
        for layer in range(cfg.num_layers):
            k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
            v = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
            storage.write(layer, storage.slot_rows(slots), k, v)
    return storage, tables


def decode(storage, tables, lens, q, layer, window, use_native):
    batch = build_decode_batch(list(range(len(lens))), [tables], lens, torch.device("cpu"), len(lens))
    native_paged._BY_STORAGE.pop(storage, None)
    if not use_native:
        native_paged._BY_STORAGE[storage] = None
    attn = PagedAttention(storage, PagedAttentionMetadata((torch.zeros(0, dtype=torch.long),), [], batch))
    assert (attn.native is not None) == use_native
    return attn._decode_attention(layer, q, window, 0.125)


def prefill(storage, table, context_len, q, layer, window, use_native):
    """q: the last len(q) queries of a sequence of context_len tokens whose k/v are stored."""
    seq = SequenceSlice(0, q.shape[0], context_len, (torch.tensor(table),))
    native_paged._BY_STORAGE.pop(storage, None)
    if not use_native:
        native_paged._BY_STORAGE[storage] = None
    attn = PagedAttention(storage, PagedAttentionMetadata((torch.zeros(0, dtype=torch.long),), [seq]))
    assert (attn.native is not None) == use_native
    attn.write = lambda *args: None  # the k/v are in the storage already
    k = v = torch.zeros(q.shape[0], storage.num_kv_heads, q.shape[2])
    return attn.attend(layer, q, k, v, window, 0.125)
