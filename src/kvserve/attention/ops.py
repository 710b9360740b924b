"""Attention math for one sequence: a chunk of queries against the sequence's whole key history.

      keys (positions)  0 1 2 3 4 5 6 7
      query at pos 5    x x x x x x . .    attends to keys <= its own position
      query at pos 6    x x x x x x x .    (and, in a sliding-window layer, to keys > pos - window)

Queries are processed in tiles of ``QUERY_TILE`` so that a long prompt never builds a
[seq, seq] score matrix; inside a tile torch's fused SDPA does the online softmax. Soft-capped scores
(Gemma 2: s -> cap * tanh(s / cap) before the softmax) are explicit instead (``capped_attention``), a tile
of ``CAPPED_QUERY_TILE`` queries at a time: the path where no native kernel caps them.
"""

from __future__ import annotations

from kvserve.lazy_torch import F, torch

QUERY_TILE = 1024
CAPPED_QUERY_TILE = 256  # queries scored at a time: [heads, tile, keys] scores, never [heads, seq, seq]


def _mask(q_positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    key_positions = torch.arange(num_keys, device=q_positions.device)
    allowed = key_positions[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= key_positions[None, :] > q_positions[:, None] - window
    return allowed  # [num_queries, num_keys]


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_q, num_heads, head_dim] at positions q_start..q_start+num_q-1;
    k, v: head-major [num_kv_heads, num_keys, head_dim] at positions 0..num_keys-1
    (num_keys = q_start + num_q). Returns [num_q, num_heads, head_dim]. ``softcap``: scores capped
    (None or 0: not)."""
    if softcap:
        return _sequence_capped(q, k, v, q_start, window, scale, softcap)
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
        o = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    assert num_keys >= q_start + num_q
    return out


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


def _sequence_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None,
                     scale: float, cap: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], CAPPED_QUERY_TILE):
        end = min(start + CAPPED_QUERY_TILE, q.shape[0])
        allowed = _mask(torch.arange(q_start + start, q_start + end, device=k.device), k.shape[1], window)
        out[start:end] = capped_attention(q[start:end], k[None], v[None], allowed[:, None, :], scale, cap)
    return out

