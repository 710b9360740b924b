"""Attention over the paged KV cache for a flat batch of tokens from many sequences.

    flat tokens      | seq A: 5 prompt tokens | seq B: 1 decode token | seq C: chunk of 3 |
    query_start       0                        5                       6
    context_len       5                        41                      19   (cached + this step)

Prefill chunks attend one sequence at a time, causally, to their history plus themselves. Decode
tokens (one query per sequence) are attended together in one batched call over block tables padded
to the longest context, with a length mask:

    block_tables [num_decodes, max_blocks]   ->  K [num_decodes, num_kv_heads, max_blocks * block_size,
    head_dim]
                                                 (one index_select of head-major blocks, no transpose)
    mask         key index < context_len (and > position - window in sliding-window layers)

With a window group (``kv.groups``), the sliding layers write and read through the window
tables and slots beside the block tables and slots; ``kv_group`` picks them for a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.attention import native_paged
from kvserve.attention.ops import capped_attention, sequence_attention
from kvserve.kv.storage import PagedKVStorage
from kvserve.lazy_torch import F, torch


@dataclass(slots=True)
class SequenceSlice:
    query_start: int
    query_len: int
    context_len: int  # tokens in the cache for this sequence after this step's writes
    # per KV group (storage.kv_group_blocks' order: every layer's, then the sliding layers'), the blocks of
    # positions [0, context_len): [num_blocks_used] int64
    kv_group_tables: tuple[torch.Tensor, ...]

    def table(self, kv_group: int) -> torch.Tensor:
        return self.kv_group_tables[kv_group]


@dataclass(slots=True)
class DecodeBatch:
    """The single-token sequences of a step, attended in one call."""

    token_rows: torch.Tensor  # [num_decodes] row of each decode token in the flat batch
    kv_group_tables: tuple[torch.Tensor, ...]  # per KV group, [num_decodes, max_blocks] padded with block 0
    context_lens: torch.Tensor  # [num_decodes]
    only_decodes: bool = False  # the step's tokens are exactly these, in order (rows 0..n-1)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [num_decodes, 1, 1, keys]

    def tables(self, kv_group: int) -> torch.Tensor:
        return self.kv_group_tables[kv_group]

    def mask(self, window: int | None, num_keys: int) -> torch.Tensor:
        if window not in self.masks:
            keys = torch.arange(num_keys, device=self.context_lens.device)[None, :]
            lens = self.context_lens[:, None]
            allowed = keys < lens
            if window is not None:
                allowed &= keys > lens - 1 - window
            self.masks[window] = allowed[:, None, None, :]
        return self.masks[window]


@dataclass(slots=True)
class PagedAttentionMetadata:
    """One step's batch as every attention backend reads it: per KV group, each token's slot and each
    sequence's block table (``slots(g)``, ``SequenceSlice.table(g)``, ``DecodeBatch.tables(g)``)."""

    kv_group_slots: tuple[torch.Tensor, ...]  # per KV group, [num_tokens] flat slot of each token
    sequences: list[SequenceSlice]  # sequences attended one by one (prefill chunks)
    decodes: DecodeBatch | None = None  # single-token sequences attended together

    def slots(self, kv_group: int) -> torch.Tensor:
        return self.kv_group_slots[kv_group]


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


def build_decode_batch(
    token_rows: list[int], kv_group_tables: list[list[list[int]]], context_lens: list[int],
    device: torch.device, num_tokens: int | None = None,
) -> DecodeBatch:
    """kv_group_tables: per KV group, each decode's block table."""
    return DecodeBatch(
        torch.tensor(token_rows, dtype=torch.long, device=device),
        tuple(_padded(tables, device) for tables in kv_group_tables),
        torch.tensor(context_lens, dtype=torch.long, device=device),
        only_decodes=num_tokens == len(token_rows) and token_rows == list(range(len(token_rows))),
    )


class PagedAttention:
    """``AttentionBackend`` for one forward: writes this step's k/v, then attends."""

    def __init__(self, storage: PagedKVStorage, metadata: PagedAttentionMetadata) -> None:
        self.storage = storage
        self.metadata = metadata
        kv_groups = range(len(storage.kv_group_blocks))
        # index rows shared by every layer of a group in this forward
        self.slot_rows = [storage.slot_rows(metadata.slots(g), g) for g in kv_groups]
        self.sequence_rows: dict[tuple[int, int], torch.Tensor] = {}
        self.write = native_paged.writer_for_storage(storage)
        self.native = native_paged.for_storage(storage)
        self.decode_rows = None
        if metadata.decodes is not None and self.native is None:
            self.decode_rows = [storage.block_rows(metadata.decodes.tables(g), g) for g in kv_groups]

    def attend(self, layer, q, k, v, window, scale, softcap: float | None = None):
        """``softcap``: scores s -> softcap * tanh(s / softcap) before the softmax (Gemma 2); the native
        kernels cap each score themselves, without them the scores are capped in torch (``ops``)."""
        storage = self.storage
        kv_group = storage.kv_group_of_layer[layer]
        self.write(layer, self.slot_rows[kv_group], k, v)
        d = self.metadata.decodes
        if d is not None and d.only_decodes:  # a pure decode step: no scatter into a prefill batch
            return self._decode_attention(layer, q, window, scale, softcap)
        out = torch.empty_like(q)
        if self.metadata.sequences and self.native is not None:  # blocks read in place, quantized or not;
            for s in self.metadata.sequences:  # rotated codecs' q rotated and output un-rotated in the kernel
                out[s.query_start : s.query_start + s.query_len] = self.native.prefill(
                    layer, q[s.query_start : s.query_start + s.query_len], s.context_len - s.query_len,
                    s.table(kv_group), window, scale, softcap)
        elif self.metadata.sequences:
            rotated = storage.query(layer, q)  # balanced, rotated keys: score with such a query
            for i, s in enumerate(self.metadata.sequences):
                qs = rotated[s.query_start : s.query_start + s.query_len]
                keys, values = storage.gather(layer, self.sequence_block_rows(i, kv_group), s.context_len,
                                              q.dtype)
                out[s.query_start : s.query_start + s.query_len] = sequence_attention(
                    qs, keys, values, s.context_len - s.query_len, window, scale, softcap)
            out = storage.v_codec.unrotate(out)  # values were summed in their rotated domain
        if d is not None:
            decoded = self._decode_attention(layer, q.index_select(0, d.token_rows), window, scale, softcap)
            out.index_copy_(0, d.token_rows, decoded)
        return out

    def sequence_block_rows(self, i: int, kv_group: int) -> torch.Tensor:
        """Storage rows of prefill sequence i's blocks in ``kv_group``, computed once per forward (shared by
        every layer of the group)."""
        if (i, kv_group) not in self.sequence_rows:
            table = self.metadata.sequences[i].table(kv_group)
            self.sequence_rows[i, kv_group] = self.storage.block_rows(table, kv_group)
        return self.sequence_rows[i, kv_group]

    def _decode_attention(self, layer, q, window, scale, softcap=None) -> torch.Tensor:
        """q: [n, heads, head_dim], one query per decoding sequence -> [n, heads, head_dim]. Rotated
        codecs' rotations happen here (in the C kernel when there is one), so a sequence's decode is the
        same arithmetic in a pure decode step and in a step mixed with prefills."""
        d = self.metadata.decodes
        kv_group = self.storage.kv_group_of_layer[layer]
        if self.native is not None:  # reads the blocks in place, quantized or not
            return self.native.decode(layer, q, d.tables(kv_group), d.context_lens, window, scale, softcap)
        q = self.storage.query(layer, q)
        # [n, kv_heads, keys, head_dim]
        keys, values = self.storage.read_blocks(layer, self.decode_rows[kv_group], q.dtype)
        mask = d.mask(window, keys.shape[2])
        if softcap:
            return self.storage.v_codec.unrotate(capped_attention(q, keys, values, mask[:, 0], scale,
                                                                  softcap))
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
        )
        return self.storage.v_codec.unrotate(o.squeeze(2))
