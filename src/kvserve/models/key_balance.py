"""Keys balanced against the queries: a scale per layer, KV head and coordinate, read from the weights.

A score is q . k = sum_i (q_i / s_i) (k_i s_i) for any s > 0, so quantized keys may be stored times s
and every query divided by it (``kv.storage``, the C writer and attention kernels) with attention
unchanged. What changes is where the codes' error lands. After the rotation of q8_0/q4_0 keys that
error is about even across coordinates, so a score's error grows with |q| |k s| / ... and the best s
puts the precision where the queries are large: s_i^2 = rms(q_i) / rms(k_i) (Cauchy-Schwarz), which
shrinks the score error's variance by

    gain = sum(rms(q)^2) sum(rms(k)^2) / (sum rms(q) rms(k))^2   (>= 1)

Measured on 512 tokens of the models' own activations the gain is ~1.0-1.3 for SmolLM2, 9-19 in
Gemma 3's layers 5, 11 and 15 (whose query and key norm weights pull apart) and 16-48 in Qwen2.5's
layer 0 (whose K bias, turning with RoPE, dwarfs its keys' content); those layers were what kept their
q8_0 keys under 99% top-1 on some texts.

Here the rms come from the weights, not from activations: with RMSNorm over per-head q/k (Gemma 3,
Qwen3) a coordinate's rms follows its norm weight; otherwise it is the norm of its projection row times
the input norm's weight, with the bias (less any key centre) added in quadrature, i.e. the rms of the
projection of a unit-variance input. RoPE mixes the coordinates of each rotated pair, so both take the
pair's mean square. A KV head is balanced only where this estimate promises ``MIN_GAIN``: SmolLM2's
layers estimate <= 1.28 and measured slightly worse balanced (q8_0 KLD 0.00028 -> 0.00033, GPL-3 text),
so near-even heads are left as they are.
"""

from __future__ import annotations

import numpy as np

from kvserve.lazy_torch import as_numpy
from kvserve.models.linear import weight_array

MIN_GAIN = 1.5


def pair_mean(x: np.ndarray, rotated: int) -> np.ndarray:
    """x [..., D] with its first ``rotated`` coordinates in RoPE pairs (j, j + rotated / 2): each pair's
    two values replaced by their mean."""
    half = rotated // 2
    out = x.copy()
    mean = (x[..., :half] + x[..., half:rotated]) / 2
    out[..., :half] = mean
    out[..., half:rotated] = mean
    return out


def head_scales(q_ms: np.ndarray, k_ms: np.ndarray) -> np.ndarray | None:
    """Per KV head, mean squares of the queries [kv_heads, D] (over the head's group) and of the keys:
    the scales [kv_heads, D] f32 (geometric mean 1 per head; 1 where a head gains less than ``MIN_GAIN``),
    or None when no head is worth it."""
    q_rms, k_rms = np.sqrt(np.maximum(q_ms, 0)), np.sqrt(np.maximum(k_ms, 0))
    gain = q_ms.sum(-1) * k_ms.sum(-1) / np.maximum(np.square((q_rms * k_rms).sum(-1)), 1e-30)
    usable = (q_rms > 0) & (k_rms > 0)
    scales = np.where(usable, np.sqrt(q_rms / np.maximum(k_rms, 1e-30)), 1.0)
    log = np.log(np.where(usable, scales, 1.0))
    scales = scales / np.exp(log.sum(-1, keepdims=True) / np.maximum(usable.sum(-1, keepdims=True), 1))
    scales = np.where(usable & (gain >= MIN_GAIN)[:, None], scales, 1.0)
    return scales.astype(np.float32) if bool((gain >= MIN_GAIN).any()) else None


def layer_mean_squares(layer, q_dim: int, kv_dim: int, heads: int, kv_heads: int, head_dim: int,
                       centre: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The estimated mean squares of one layer's queries [heads, D] and keys [kv_heads, D] (f32), or None
    where the weights do not say (no readable projection, one of q/k normed without the other)."""
    if layer.q_norm is not None or layer.k_norm is not None:
        if layer.q_norm is None or layer.k_norm is None:
            return None
        q_ms, k_ms = (np.square(_f32(w)).ravel() for w in (layer.q_norm, layer.k_norm))
        # per-head weights [D] shared by every head, or one weight per coordinate of all heads (olmoe)
        return (np.tile(q_ms, q_dim // q_ms.size).reshape(heads, head_dim),
                np.tile(k_ms, kv_dim // k_ms.size).reshape(kv_heads, head_dim))
    weight = weight_array(layer.qkv)
    if weight is None:
        return None
    rows = weight[: q_dim + kv_dim] * _f32(layer.attn_norm)
    ms = np.square(rows).sum(-1)
    bias = getattr(layer.qkv, "bias", None)
    if bias is not None:
        b = _f32(bias)[: q_dim + kv_dim].copy()
        if centre is not None:
            b[q_dim:] -= _f32(centre).ravel()
        ms = ms + np.square(b)
    return ms[:q_dim].reshape(heads, head_dim), ms[q_dim:].reshape(kv_heads, head_dim)


def _f32(v) -> np.ndarray:
    return np.asarray(as_numpy(v), dtype=np.float32)


def key_balance(model, centres: list[np.ndarray | None] | None) -> list[np.ndarray | None] | None:
    """Per layer of a ``DecoderLM``, the keys' scales [kv_heads, head_dim] f32 (None: the layer as it
    is); None when no layer is balanced. ``centres``: the model's ``key_centres()``."""
    cfg = model.config
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    centres = centres or [None] * len(model.layers)
    out = []
    for i, layer in enumerate(model.layers):
        ms = layer_mean_squares(layer, model.q_dim, model.kv_dim, heads, kv_heads, d, centres[i])
        if ms is None:
            out.append(None)
            continue
        rotated = 2 * len((model.rope_local if cfg.is_sliding(i) else model.rope).inv_freq)
        q_ms, k_ms = (pair_mean(x, rotated) for x in ms)
        out.append(head_scales(q_ms.reshape(kv_heads, heads // kv_heads, d).mean(1), k_ms))
    return out if any(s is not None for s in out) else None
