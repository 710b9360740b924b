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
from numpy.typing import ArrayLike

from kvserve import native
from kvserve.config import ModelConfig
from kvserve.host_memory import zeroed_array
from kvserve.lazy_torch import Device, dtype_name, torch, torch_dtype


def inverse_frequencies(
    config: ModelConfig, base: float, freq_factors: ArrayLike | None = None, long_context: bool = False
) -> np.ndarray:
    """float64 [rotated dims / 2]. long_context: LongRoPE's long factors instead of its short ones (see
    ``rotary_embedding``). numpy, whose ``power`` is the C library's (torch's vectorized pow, used before,
    differed from it in the last bit for ~1 in 12 frequencies)."""
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    # llama.cpp files carry Llama 3 and LongRoPE scaling as per-frequency divisors
    if freq_factors is not None:
        inv_freq = inv_freq / _float64(freq_factors)
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, scaling, base, dim)
    elif scaling.rope_type == "longrope":
        factors = scaling.long_factor if long_context else scaling.short_factor
        if factors:
            inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
    return inv_freq


def _float64(values: ArrayLike) -> np.ndarray:
    """A vector (numpy, a list, a CPU tensor) as float64 numpy."""
    return np.asarray(values, dtype=np.float64)


def rotary_embedding(config: ModelConfig, weights, device: Device, dtype: str) -> RotaryEmbedding:
    """The model's rotary embedding at ``config.rope_theta``. ``weights`` may hold a GGUF's per-frequency
    divisors: ``rope_freqs`` (Llama 3), ``rope_factors_short.weight`` / ``rope_factors_long.weight``
    (LongRoPE; an HF config carries those as short_factor / long_factor). LongRoPE starts on its short
    factors; ``RotaryEmbedding.fit_context`` moves to the long ones for a context past the original."""
    scale = attention_factor(config)
    if config.rope_scaling.rope_type != "longrope":
        inv_freq = inverse_frequencies(config, config.rope_theta, weights.get_array("rope_freqs"))
        return RotaryEmbedding(inv_freq, device, dtype, scale)
    short = inverse_frequencies(config, config.rope_theta, weights.get_array("rope_factors_short.weight"))
    long_factors = weights.get_array("rope_factors_long.weight")
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


def _yarn_scale(inv_freq: np.ndarray, s, base: float, dim: int) -> np.ndarray:
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
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def _llama3_scale(inv_freq: np.ndarray, s) -> np.ndarray:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


ROPE_CHUNK = 4096  # positions whose tables are computed in float64 at a time
ROPE_STEP = 256  # positions filled at least at a time in a served context's buffer


class RotaryEmbedding:
    """cos/sin tables grown on demand (sin with the rotation's sign folded into its first half), as wide
    as the rotated dims; ``apply_rotary`` rotates q and k at explicit positions.

    The tables are computed in float64 numpy and held as numpy f32 arrays for the CPU runtime (f32 on the
    CPU: ``rows_into`` reads them, torch code sees them through ``cos`` / ``sin`` views), as tensors on
    the device otherwise."""

    def __init__(
        self,
        inv_freq: ArrayLike,
        device: Device,
        dtype: str,
        scale: float = 1.0,
        long_context: tuple[ArrayLike, int] | None = None,
    ) -> None:
        """inv_freq: float64 frequencies (``inverse_frequencies``); dtype: the tables' element type by
        name (a torch dtype is taken too); long_context: LongRoPE's (long-factor frequencies, original
        context length), for ``fit_context``."""
        self.inv_freq = self.short_inv_freq = _float64(inv_freq)
        self.long_context = None if long_context is None else (_float64(long_context[0]), long_context[1])
        self.scale = scale  # YaRN / LongRoPE attention factor, folded into the tables (either factor set)
        self.device = device
        self.dtype = dtype_name(dtype)
        self.host = device.type == "cpu" and self.dtype == "float32"  # numpy tables
        self.max_length: int | None = None  # the served context (fit_context): tables never grow past it
        self._buffers: tuple = ()  # cos, sin storage (numpy on the host, else tensors); rows [0, filled) set
        self.filled = 0

    @property
    def width(self) -> int:
        return 2 * len(self.inv_freq)

    @property
    def cos(self) -> torch.Tensor:
        """The filled rows of the cos table as a tensor (a view of the numpy table on the host)."""
        return self._tensor(0)

    @property
    def sin(self) -> torch.Tensor:
        return self._tensor(1)

    def _tensor(self, i: int) -> torch.Tensor:
        if not self._buffers:
            return torch.empty(0, self.width, device=self.device, dtype=torch_dtype(self.dtype))
        rows = self._buffers[i][: self.filled]
        return torch.from_numpy(rows) if self.host else rows

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
            self._buffers, self.filled = (), 0

    def _grow(self, length: int) -> None:
        """Tables of at least ``length`` positions. Within the served context (``fit_context``): rows
        filled in place in one buffer of the context's size, whose pages stay unmapped until written
        (``host_memory.zeroed_array``), ROPE_STEP positions or more at a time: no copy and no old table
        beside a new one, which doubling left behind as holes in the heap that a long prefill's
        temporaries then wandered over (Gemma 3's two tables at 8K: 16 MiB held beside 8 MiB, twice).
        Past it: just the rows asked for; without one: doubling; a copy each time. Rows are computed a chunk
        of positions at a time, so the float64 math never holds a whole table (32K positions of 256 dims: ~200
        MiB)."""
        filled = self.filled
        if self.max_length is not None and length <= self.max_length:
            end = min(self.max_length, max(length, filled + ROPE_STEP))
            if not self._buffers or len(self._buffers[0]) < self.max_length:
                self._reallocate(self.max_length, zeroed=True)
        else:
            end = max(length, 2 * filled, 256)
            if self.max_length is not None:  # a position past the served context: its row, no more
                end = length
            self._reallocate(end, zeroed=False)
        width = self.width
        for start in range(filled, end, ROPE_CHUNK):
            t = np.arange(start, min(start + ROPE_CHUNK, end), dtype=np.float64)
            freqs = np.outer(t, self.inv_freq)  # [chunk, rotated / 2]
            emb = np.concatenate([freqs, freqs], axis=-1)
            c, s = np.cos(emb), np.sin(emb)
            if self.scale != 1.0:
                c, s = c * self.scale, s * self.scale
            s[:, : width // 2] *= -1  # sign folded in: apply_rotary needs no negation
            for table, rows in zip(self._buffers, (c, s), strict=True):
                if self.host:
                    table[start : start + len(t)] = rows  # rounded to f32 by the assignment
                else:
                    table[start : start + len(t)] = torch.from_numpy(rows).to(self.device,
                                                                             torch_dtype(self.dtype))
        self.filled = end

    def _reallocate(self, rows: int, zeroed: bool) -> None:
        """Storage of ``rows`` rows for both tables, the rows filled so far copied over."""
        width = self.width
        if self.host:
            def new() -> np.ndarray:
                if zeroed:
                    return zeroed_array(rows * width * 4).view(np.float32).reshape(rows, width)
                return np.empty((rows, width), dtype=np.float32)
        else:
            def new() -> torch.Tensor:
                make = torch.zeros if zeroed else torch.empty
                return make(rows, width, device=self.device, dtype=torch_dtype(self.dtype))
        buffers = (new(), new())
        for old, table in zip(self._buffers, buffers, strict=False):
            table[: self.filled] = old[: self.filled]
        self._buffers = buffers

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [num_tokens, 1, head_dim] (broadcast over heads)."""
        if max_position >= self.filled:
            self._grow(max_position + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rows_into(self, positions: np.ndarray, max_position: int, cos: np.ndarray, sin: np.ndarray) -> None:
        """``tables``' rows of ``positions`` [n] (int64) copied into ``cos``, ``sin`` (f32 [n, width]: the
        one-call step's buffers), straight from the numpy tables. CPU f32 only."""
        if max_position >= self.filled:
            self._grow(max_position + 1)
        np.take(self._buffers[0][: self.filled], positions, axis=0, out=cos)
        np.take(self._buffers[1][: self.filled], positions, axis=0, out=sin)


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
