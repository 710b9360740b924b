"""Rotary position embeddings (half-split layout), with Llama 3 and linear frequency scaling.

``apply_rotary`` returns rotated copies (torch); ``rotate_heads`` rotates the leading heads of a
fused qkv, in place through ``native/rope.c`` where it runs (the same bits), else through
``apply_rotary``.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from kvserve import native
from kvserve.config import ModelConfig


def inverse_frequencies(
    config: ModelConfig, base: float, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if freq_factors is not None:  # llama.cpp files carry Llama 3 scaling as per-frequency divisors
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables grown on demand (sin with the rotation's sign folded into its first half);
    ``apply_rotary`` rotates q and k at explicit positions."""

    def __init__(self, inv_freq: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq
        self.device = device
        self.dtype = dtype
        self.cos = torch.empty(0, device=device)
        self.sin = torch.empty(0, device=device)

    def _grow(self, length: int) -> None:
        length = max(length, 2 * self.cos.shape[0], 256)
        t = torch.arange(length, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)  # [length, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device, self.dtype)
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()  # sign folded in: apply_rotary needs no negation
        self.sin = sin.to(self.device, self.dtype)

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [num_tokens, 1, head_dim] (broadcast over heads)."""
        if max_position >= self.cos.shape[0]:
            self._grow(max_position + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (x2, x1); sin carries the (-, +) signs
    return x * cos + rotated * sin


@cache  # looked up once a layer: one cache hit without arguments
def _kernel():
    return native.function("rope", "rope_in_place")


def rotate_heads(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, total_heads, head_dim] with heads [0, heads) rotated (the rest, e.g. the values
    of a fused qkv, as they were) by cos/sin [num_tokens, 1, head_dim] from ``tables``. In place
    through the kernel (f32 on the CPU, contiguous); otherwise a new tensor from ``apply_rotary``."""
    kernel = _kernel() if x.device.type == "cpu" else None
    if (kernel is None or x.dtype != torch.float32 or not x.is_contiguous()
            or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())):
        return torch.cat([apply_rotary(x[:, :heads], cos, sin), x[:, heads:]], 1)
    n, total, head_dim = x.shape
    kernel(x.data_ptr(), n, heads, total * head_dim, head_dim, cos.data_ptr(), sin.data_ptr())
    return x
