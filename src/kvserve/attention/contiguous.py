"""A dense per-sequence KV cache: the reference path the paged engine is checked against."""

from __future__ import annotations

from kvserve.attention.ops import sequence_attention
from kvserve.lazy_torch import torch


class ContiguousKVCache:
    """One sequence; k/v of every layer appended in order. Implements ``AttentionBackend``."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer, q, k, v, window, scale, softcap: float | None = None):
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k])
            self.values[layer] = torch.cat([self.values[layer], v])
        keys, values = self.keys[layer].transpose(0, 1), self.values[layer].transpose(0, 1)
        return sequence_attention(q, keys, values, keys.shape[1] - q.shape[0], window, scale, softcap)
