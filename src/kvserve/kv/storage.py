"""Paged K/V storage: per layer, K and V each as codec parts ``[num_blocks, block_size, num_kv_heads, width]``.

Written through a slot mapping (flat slot = block_id * block_size + offset), read through block
tables. K and V may use different codecs (``--cache-type-k`` / ``--cache-type-v``); the element
type is a property of the storage only, bookkeeping never sees it.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.kv.codecs import KVCodec, make_codec


class PagedKVStorage:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        cache_type: str,
        device: torch.device,
        cache_type_v: str | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k_codec: KVCodec = make_codec(cache_type, config.head_dim)
        self.v_codec: KVCodec = make_codec(cache_type_v or cache_type, config.head_dim)
        heads = config.num_kv_heads

        def allocate(codec: KVCodec) -> list[torch.Tensor]:
            return [torch.zeros((num_blocks, block_size, heads, w), dtype=d, device=device) for w, d in codec.part_specs()]

        self.k = [allocate(self.k_codec) for _ in range(config.num_layers)]
        self.v = [allocate(self.v_codec) for _ in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for layer in self.k + self.v for p in layer)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] encoded and stored at their flat slots."""
        for parts, codec, x in ((self.k[layer], self.k_codec, k), (self.v[layer], self.v_codec, v)):
            for stored, encoded in zip(parts, codec.encode(x)):
                stored.view(-1, *stored.shape[2:]).index_copy_(0, slot_mapping, encoded)

    def read_blocks(
        self, layer: int, block_table: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K and V of the given blocks: block_table [..., n] -> [..., n, block_size, heads, head_dim],
        in the codec's attention domain (rotated for rotated codecs)."""
        k = self.k_codec.decode([p[block_table] for p in self.k[layer]], dtype)
        v = self.v_codec.decode([p[block_table] for p in self.v[layer]], dtype)
        return k, v

    def gather(
        self, layer: int, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` K/V of one sequence: [num_tokens, num_kv_heads, head_dim] each."""
        k, v = self.read_blocks(layer, block_table, dtype)
        return k.flatten(0, 1)[:num_tokens], v.flatten(0, 1)[:num_tokens]
