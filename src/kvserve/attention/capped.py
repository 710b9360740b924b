"""Attention with soft-capped scores (Gemma 2: s -> cap * tanh(s / cap) before the softmax), in torch:
the path of a backend without native kernels (the kernels cap each score themselves, reading the blocks
in place). Scores are explicit here, a tile of queries at a time, never [heads, seq, seq].
"""

from __future__ import annotations

import torch

CAPPED_QUERY_TILE = 256  # queries scored at a time: [heads, tile, keys] scores, never [heads, seq, seq]


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """q [n, heads, D]; k, v [n or 1, kv_heads, keys, D]; allowed [n or 1, 1 or n, keys] bool (True: attend).
    Returns [n, heads, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # [., heads, keys, D]
    scores = torch.einsum("nhd,nhkd->nhk", q.float(), k.float()) if k.shape[0] == q.shape[0] else \
        torch.einsum("nhd,hkd->nhk", q.float(), k[0].float())
    scores = torch.tanh(scores * (scale / cap)) * cap
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, -1)
    out = torch.einsum("nhk,nhkd->nhd", probs, v.float()) if v.shape[0] == q.shape[0] else \
        torch.einsum("nhk,hkd->nhd", probs, v[0].float())
    return out.to(q.dtype)


def sequence_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None,
                    scale: float, cap: float) -> torch.Tensor:
    """One sequence's chunk of queries at positions q_start.. against k, v [kv_heads, keys, D]."""
    out = torch.empty_like(q)
    keys = torch.arange(k.shape[1], device=k.device)
    for start in range(0, q.shape[0], CAPPED_QUERY_TILE):
        end = min(start + CAPPED_QUERY_TILE, q.shape[0])
        pos = torch.arange(q_start + start, q_start + end, device=k.device)[:, None]
        allowed = keys[None, :] <= pos
        if window is not None:
            allowed &= keys[None, :] > pos - window
        out[start:end] = capped_attention(q[start:end], k[None], v[None], allowed[:, None, :], scale, cap)
    return out
