"""Paged K/V tensors: one pair per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Written through a slot mapping (flat slot = block_id * block_size + offset), read through block
tables. The element type is a property of the storage; bookkeeping never sees it.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig

CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def cache_dtype(name: str) -> torch.dtype:
    try:
        return CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name!r}; choose one of {', '.join(CACHE_DTYPES)}") from None


def bytes_per_token(config: ModelConfig, dtype_name: str) -> int:
    """K plus V bytes per token over all layers: 2 x layers x kv_heads x head_dim x element size."""
    return config.kv_size_per_token * torch.empty(0, dtype=cache_dtype(dtype_name)).element_size()


class PagedKVStorage:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype_name: str, device: torch.device
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = cache_dtype(dtype_name)
        self.dtype_name = dtype_name
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] stored at their flat slots."""
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slot_mapping, k.to(self.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` K/V of a sequence: [num_tokens, num_kv_heads, head_dim] each."""
        k = self.k[layer].index_select(0, block_table).flatten(0, 1)[:num_tokens]
        v = self.v[layer].index_select(0, block_table).flatten(0, 1)[:num_tokens]
        return k, v
