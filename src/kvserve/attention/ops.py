"""Attention math for one sequence: a chunk of queries against the sequence's whole key history.

      keys (positions)  0 1 2 3 4 5 6 7
      query at pos 5    x x x x x x . .    attends to keys <= its own position
      query at pos 6    x x x x x x x .    (and, in a sliding-window layer, to keys > pos - window)

Queries are processed in tiles of ``QUERY_TILE`` so that a long prompt never builds a
[seq, seq] score matrix; inside a tile torch's fused SDPA does the online softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_TILE = 1024


def _mask(q_positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    key_positions = torch.arange(num_keys, device=q_positions.device)
    allowed = key_positions[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= key_positions[None, :] > q_positions[:, None] - window
    return allowed  # [num_queries, num_keys]


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None, scale: float
) -> torch.Tensor:
    """q: [num_q, num_heads, head_dim] at positions q_start..q_start+num_q-1;
    k, v: head-major [num_kv_heads, num_keys, head_dim] at positions 0..num_keys-1
    (num_keys = q_start + num_q). Returns [num_q, num_heads, head_dim]."""
    num_q, num_keys = q.shape[0], k.shape[1]
    gqa = q.shape[1] != k.shape[0]
    out = torch.empty_like(q)
    for start in range(0, num_q, QUERY_TILE):
        end = min(start + QUERY_TILE, num_q)
        qt = q[start:end].transpose(0, 1)  # [num_heads, tile, head_dim]
        first_pos = q_start + start
        last_pos = q_start + end - 1
        keys_needed = last_pos + 1
        key_lo = 0 if window is None else max(0, first_pos - window + 1)
        kk, vv = k[:, key_lo:keys_needed], v[:, key_lo:keys_needed]
        if end - start == 1:
            mask, causal = None, False  # one query sees every key in [key_lo, keys_needed)
        elif window is None and first_pos == 0:
            mask, causal = None, True  # square causal tile starting at position 0
        else:
            positions = torch.arange(first_pos, last_pos + 1, device=q.device)
            mask = _mask(positions - key_lo, keys_needed - key_lo, window)
            causal = False
        o = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    assert num_keys >= q_start + num_q
    return out
