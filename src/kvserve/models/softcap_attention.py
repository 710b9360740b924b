"""Attention with soft-capped scores (Gemma 2: s -> cap * tanh(s / cap) before the softmax).

``AttentionBackend.attend`` takes no score cap, so a model that has one wraps the step's backend in
``SoftcapAttention``, which attends with the cap. Over a paged cache whose storage has the native
kernels it hands the cap to ``PagedAttention.attend`` (the kernels cap each score themselves, reading
the blocks in place). Otherwise, and over a contiguous cache, it stores k/v through the backend and
attends in torch: the history read back through the KV storage (every KV type: decoded rows, rotated
codecs' rotations as the paged path does them), explicit capped scores.
"""

from __future__ import annotations

import torch

from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.attention.paged import PagedAttention

QUERY_TILE = 256  # queries scored at a time: [heads, tile, keys] scores, never [heads, seq, seq]


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
    for start in range(0, q.shape[0], QUERY_TILE):
        end = min(start + QUERY_TILE, q.shape[0])
        pos = torch.arange(q_start + start, q_start + end, device=k.device)[:, None]
        allowed = keys[None, :] <= pos
        if window is not None:
            allowed &= keys[None, :] > pos - window
        out[start:end] = capped_attention(q[start:end], k[None], v[None], allowed[:, None, :], scale, cap)
    return out


class SoftcapAttention:
    """An ``AttentionBackend`` over the backend of this forward (contiguous or paged), capping scores."""

    def __init__(self, inner, cap: float) -> None:
        if not isinstance(inner, (ContiguousKVCache, PagedAttention)):
            raise TypeError(f"soft-capped attention cannot read the KV history of {type(inner).__name__}")
        self.inner, self.cap = inner, cap

    def attend(self, layer, q, k, v, window, scale):
        inner = self.inner
        if isinstance(inner, ContiguousKVCache):
            if inner.keys[layer] is None:
                inner.keys[layer], inner.values[layer] = k, v
            else:
                inner.keys[layer] = torch.cat([inner.keys[layer], k])
                inner.values[layer] = torch.cat([inner.values[layer], v])
            keys, values = inner.keys[layer].transpose(0, 1), inner.values[layer].transpose(0, 1)
            return sequence_capped(q, keys, values, keys.shape[1] - q.shape[0], window, scale, self.cap)
        return self._paged(layer, q, k, v, window, scale)

    def _paged(self, layer, q, k, v, window, scale):
        inner = self.inner
        if inner.native is not None:  # the kernels cap each score themselves
            return inner.attend(layer, q, k, v, window, scale, self.cap)
        group = inner.storage.group_of_layer[layer]
        inner.write(layer, inner.slot_rows[group], k, v)
        return self._paged_torch(layer, group, q, window, scale)

    def _paged_torch(self, layer, group, q, window, scale):
        inner, storage, meta = self.inner, self.inner.storage, self.inner.metadata
        rotated = storage.k_codec.rotate(q)  # rotated keys: score with the rotated query
        out = torch.empty_like(q)
        for i, s in enumerate(meta.sequences):
            keys, values = storage.gather(layer, inner.sequence_block_rows(i, group), s.context_len, q.dtype)
            rows = slice(s.query_start, s.query_start + s.query_len)
            out[rows] = sequence_capped(rotated[rows], keys, values, s.context_len - s.query_len, window, scale,
                                        self.cap)
        d = meta.decodes
        if d is not None:
            keys, values = storage.read_blocks(layer, storage.block_rows(d.tables(group), group), q.dtype)
            allowed = d.mask(window, keys.shape[2])[:, 0]  # [n, 1, keys]
            out.index_copy_(0, d.token_rows, capped_attention(
                rotated.index_select(0, d.token_rows), keys, values, allowed, scale, self.cap))
        return storage.v_codec.unrotate(out)  # values were summed in their rotated domain
