"""Rotary position embeddings (half-split layout), with Llama 3, linear, YaRN and LongRoPE frequency
scaling, over all of each head or its first ``rotary_dim`` dims (partial rotary: Phi-3/4).

``apply_rotary`` returns rotated copies (torch); ``rotate_heads`` rotates the leading heads of a
fused qkv, in place through ``native/rope.c`` where it runs (the same bits), else through
``apply_rotary``.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch

from kvserve import native
from kvserve.config import ModelConfig
from kvserve.host_memory import zeroed_bytes


def inverse_frequencies(
    config: ModelConfig, base: float, freq_factors: torch.Tensor | None = None, long_context: bool = False
) -> torch.Tensor:
    """long_context: LongRoPE's long factors instead of its short ones (see ``rotary_embedding``)."""
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    # llama.cpp files carry Llama 3 and LongRoPE scaling as per-frequency divisors
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, scaling, base, dim)
    elif scaling.rope_type == "longrope":
        factors = scaling.long_factor if long_context else scaling.short_factor
        if factors:
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    return inv_freq


def rotary_embedding(config: ModelConfig, weights, device: torch.device,
                     dtype: torch.dtype) -> RotaryEmbedding:
    """The model's rotary embedding at ``config.rope_theta``. ``weights`` may hold a GGUF's per-frequency
    divisors: ``rope_freqs`` (Llama 3), ``rope_factors_short.weight`` / ``rope_factors_long.weight``
    (LongRoPE; an HF config carries those as short_factor / long_factor). LongRoPE starts on its short
    factors; ``RotaryEmbedding.fit_context`` moves to the long ones for a context past the original."""
    scale = attention_factor(config)
    if config.rope_scaling.rope_type != "longrope":
        return RotaryEmbedding(inverse_frequencies(config, config.rope_theta, weights.get("rope_freqs")),
                               device, dtype, scale)
    short = inverse_frequencies(config, config.rope_theta, weights.get("rope_factors_short.weight"))
    long_factors = weights.get("rope_factors_long.weight")
    if long_factors is None and not config.rope_scaling.long_factor:
        return RotaryEmbedding(short, device, dtype, scale)
    long = inverse_frequencies(config, config.rope_theta, long_factors, long_context=True)
    return RotaryEmbedding(short, device, dtype, scale,
                           (long, config.rope_scaling.original_max_position_embeddings))


def attention_factor(config: ModelConfig) -> float:
    """YaRN's and LongRoPE's scale of cos and sin (1 for the other variants)."""
    s = config.rope_scaling
    if s.rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.factor <= 1.0:
        return 1.0
    if s.rope_type == "yarn":
        return 0.1 * math.log(s.factor) + 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))


def _yarn_scale(inv_freq: torch.Tensor, s, base: float, dim: int) -> torch.Tensor:
    """Frequencies that turn fewer than beta_slow times over the original context interpolated (divided
    by factor), those turning more than beta_fast times kept, a linear ramp between (transformers'
    formula)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


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


ROPE_CHUNK = 4096  # positions whose tables are computed in float64 at a time
ROPE_STEP = 256  # positions filled at least at a time in a served context's buffer


class RotaryEmbedding:
    """cos/sin tables grown on demand (sin with the rotation's sign folded into its first half), as wide
    as the rotated dims; ``apply_rotary`` rotates q and k at explicit positions."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        scale: float = 1.0,
        long_context: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        """long_context: LongRoPE's (long-factor frequencies, original context length), for
        ``fit_context``."""
        self.inv_freq = inv_freq
        self.short_inv_freq = inv_freq
        self.long_context = long_context
        self.scale = scale  # YaRN / LongRoPE attention factor, folded into the tables (either factor set)
        self.device = device
        self.dtype = dtype
        self.cos = torch.empty(0, device=device)
        self.sin = torch.empty(0, device=device)
        self.max_length: int | None = None  # the served context (fit_context): tables never grow past it
        self._buffer: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of max_length positions
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # numpy views of cos, sin (CPU)

    def factors_for(self, num_ctx: int) -> str | None:
        """LongRoPE's factor set for a context of ``num_ctx``: "long" or "short"; None for other
        embeddings."""
        if self.long_context is None:
            return None
        return "long" if num_ctx > self.long_context[1] else "short"

    def fit_context(self, num_ctx: int) -> None:
        """LongRoPE: every position on the long factors when the context served is longer than the
        original, on the short ones otherwise. One set for all positions, chosen by context size as
        llama.cpp chooses (transformers by the length of the sequence it is given, the same for a
        sequence in one forward): cached keys then stay comparable with every later query. Call before
        any key is cached. For every embedding, the tables grow no longer than ``num_ctx`` positions."""
        self.max_length = max(self.max_length or 0, num_ctx)  # engines of several contexts may share a model
        if self.long_context is None:
            return
        inv_freq = self.long_context[0] if self.factors_for(num_ctx) == "long" else self.short_inv_freq
        if inv_freq is not self.inv_freq:
            self.inv_freq = inv_freq
            self.cos = torch.empty(0, device=self.device)
            self.sin = torch.empty(0, device=self.device)
            self._buffer = self._arrays = None

    def _grow(self, length: int) -> None:
        """Tables of at least ``length`` positions. Within the served context (``fit_context``): rows
        filled in place in one buffer of the context's size, whose pages stay unmapped until written
        (``host_memory.zeroed_bytes``), ROPE_STEP positions or more at a time: no copy and no old table
        beside a new one, which doubling left behind as holes in the heap that a long prefill's
        temporaries then wandered over (Gemma 3's two tables at 8K: 16 MiB held beside 8 MiB, twice).
        Past it: just the rows asked for; without one: doubling; a copy each time. Rows are computed a chunk
        of positions at a time, so the float64 math never holds a whole table (32K positions of 256 dims: ~200
        MiB)."""
        filled, width = self.cos.shape[0], 2 * self.inv_freq.shape[0]
        if self.max_length is not None and length <= self.max_length:
            end = min(self.max_length, max(length, filled + ROPE_STEP))
            if self._buffer is None or self._buffer[0].shape[0] < self.max_length:
                nbytes = self.max_length * width * torch.empty(0, dtype=self.dtype).element_size()
                self._buffer = tuple(
                    zeroed_bytes(nbytes, self.device).view(self.dtype).view(self.max_length, width)
                                     for _ in range(2))
                if filled:
                    for old, new in zip((self.cos, self.sin), self._buffer, strict=True):
                        new[:filled] = old
            cos, sin = self._buffer
        else:
            end = max(length, 2 * filled, 256)
            if self.max_length is not None:  # a position past the served context: its row, no more
                end = length
            cos = torch.empty(end, width, device=self.device, dtype=self.dtype)
            sin = torch.empty(end, width, device=self.device, dtype=self.dtype)
            if filled:
                cos[:filled], sin[:filled] = self.cos, self.sin
            self._buffer = None
        for start in range(filled, end, ROPE_CHUNK):
            t = torch.arange(start, min(start + ROPE_CHUNK, end), dtype=torch.float64)
            freqs = torch.outer(t, self.inv_freq)  # [chunk, head_dim // 2]
            emb = torch.cat([freqs, freqs], dim=-1)
            c, s = emb.cos(), emb.sin()
            if self.scale != 1.0:
                c, s = c * self.scale, s * self.scale
            s[:, : width // 2].neg_()  # sign folded in: apply_rotary needs no negation
            cos[start : start + len(t)] = c.to(self.device, self.dtype)
            sin[start : start + len(t)] = s.to(self.device, self.dtype)
        self.cos, self.sin = cos[:end], sin[:end]
        self._arrays = (self.cos.numpy(), self.sin.numpy()) if self.device.type == "cpu" else None

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [num_tokens, 1, head_dim] (broadcast over heads)."""
        if max_position >= self.cos.shape[0]:
            self._grow(max_position + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


    def rows_into(self, positions: np.ndarray, max_position: int, cos: np.ndarray, sin: np.ndarray) -> None:
        """``tables``' rows of ``positions`` [n] (int64) copied into ``cos``, ``sin`` (f32 [n, width]: the
        one-call step's buffers), read through numpy views of the tables' own memory: no torch call unless
        the tables grow. CPU only."""
        if self._arrays is None or max_position >= len(self._arrays[0]):
            self._grow(max_position + 1)
        np.take(self._arrays[0], positions, axis=0, out=cos)
        np.take(self._arrays[1], positions, axis=0, out=sin)


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
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:  # partial rotary: the rest of each head passes through
        out = x.clone()
        out[:, :heads, :rotated] = apply_rotary(x[:, :heads, :rotated], cos, sin)
        return out
    kernel = _kernel() if x.device.type == "cpu" else None
    if (kernel is None or x.dtype != torch.float32 or not x.is_contiguous()
            or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())):
        return torch.cat([apply_rotary(x[:, :heads], cos, sin), x[:, heads:]], 1)
    n, total, head_dim = x.shape
    kernel(x.data_ptr(), n, heads, total * head_dim, head_dim, cos.data_ptr(), sin.data_ptr())
    return x
