"""Attention over the paged KV cache for a flat batch of tokens from many sequences.

    flat tokens      | seq A: 5 prompt tokens | seq B: 1 decode token | seq C: chunk of 3 |
    query_start       0                        5                       6
    context_len       5                        41                      19   (cached + this step)

Each sequence's chunk attends causally to its history (read via its block table) plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.ops import sequence_attention
from kvserve.kv.storage import PagedKVStorage


@dataclass(slots=True)
class SequenceSlice:
    query_start: int
    query_len: int
    context_len: int  # tokens in the cache for this sequence after this step's writes
    block_table: torch.Tensor  # [num_blocks_used] int64, enough blocks to hold context_len


@dataclass(slots=True)
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each token
    sequences: list[SequenceSlice]


class PagedAttention:
    """``AttentionBackend`` for one forward: writes this step's k/v, then attends per sequence."""

    def __init__(self, storage: PagedKVStorage, metadata: PagedAttentionMetadata) -> None:
        self.storage = storage
        self.metadata = metadata

    def attend(self, layer, q, k, v, window, scale):
        self.storage.write(layer, self.metadata.slot_mapping, k, v)
        out = torch.empty_like(q)
        for s in self.metadata.sequences:
            keys, values = self.storage.gather(layer, s.block_table, s.context_len)
            qs = q[s.query_start : s.query_start + s.query_len]
            out[s.query_start : s.query_start + s.query_len] = sequence_attention(
                qs, keys.to(q.dtype), values.to(q.dtype), s.context_len - s.query_len, window, scale
            )
        return out
