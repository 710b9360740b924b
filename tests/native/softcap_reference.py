"""Soft-capped attention computed in float64 from a storage's rows: the reference the kernels are held to."""

from __future__ import annotations

import torch


def stored_rows(storage, layer: int, table: list[int], context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's keys and values as stored (decoded), float64 [kv_heads, context_len, D]."""
    keys, values = storage.gather(layer, storage.block_rows(torch.tensor(table)), context_len, torch.float32)
    return keys.double(), values.double()


def capped_reference(q, keys, values, positions, window, scale, cap) -> torch.Tensor:
    """float64 capped attention of queries q [n, heads, D] at ``positions`` over keys, values
    [kv_heads, keys, D]."""
    groups = q.shape[1] // keys.shape[0]
    k, v = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    scores = torch.einsum("nhd,hkd->nhk", q.double(), k) * scale
    scores = cap * torch.tanh(scores / cap)
    key_pos = torch.arange(keys.shape[1])[None, :]
    allowed = key_pos <= positions[:, None]
    if window is not None:
        allowed &= key_pos > positions[:, None] - window
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("nhk,hkd->nhd", torch.softmax(scores, -1), v)
