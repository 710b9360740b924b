"""KV codecs: how one K or V head-vector is stored in a block slot, and read back for attention.

Every codec stores a token's ``[num_kv_heads, head_dim]`` as a few *parts*, each a tensor with a
leading token dimension (codes, scales, norms). The paged storage keeps one
``[num_blocks, block_size, num_kv_heads, part_width]`` tensor per part; bookkeeping never sees them.

    type    parts (per head-vector of head_dim D)                     bits per element
    f32     D x f32                                                   32
    f16     D x f16                                                   16
    bf16    D x bf16                                                  16
    q8_0    D x int8, D/32 x f16 scale (llama.cpp q8_0)               8 + 16/32 = 8.5
    q4_0    D/2 x u8 (two 4-bit codes), D/32 x f16 scale (q4_0)       4 + 16/32 = 4.5
    fp8     D x e4m3, 1 x f16 scale per head-vector                   8 + 16/D
    tqB     D*B/8 x u8 packed Lloyd-Max indices of the rotated        B + 16/D
            vector, 1 x f16 norm (B = 2, 3, 4)

Rotated codecs (tqB, after TurboQuant, arXiv 2504.19874) store ``R x`` for a fixed random orthogonal
R (random signs, then a Walsh-Hadamard transform). Decoding stays in the rotated domain: attention
rotates the query instead (q.k = Rq.Rk) and rotates the value sum back once at the end. q8_0 and q4_0
*keys* are stored rotated the same way (``RotatedKeys``, ``make_codec(..., keys=True)``), their values
not.
"""

from __future__ import annotations

import math
from functools import cache, cached_property

import numpy as np
from numpy.typing import ArrayLike

from kvserve.kv.cache_types import GROUP, KV_TYPES, keys_rotated, kv_type
from kvserve.lazy_torch import torch

# bytes of each stored element type
ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


class KVCodec:
    """Base: full-precision storage in ``dtype``. Subclasses override the parts and the transforms."""

    name = "f32"
    dtype = "float32"  # the stored element type's name (torch's and numpy's spelling)
    rotated = False

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim

    def part_specs(self) -> list[tuple[int, str]]:
        """(width, element type name) of each stored part, per head-vector: names, so that sizing and
        allocating a pool on the CPU needs no torch."""
        return [(self.head_dim, self.dtype)]

    def bytes_per_vector(self) -> int:
        return sum(w * ITEM_SIZES[d] for w, d in self.part_specs())

    def bits_per_element(self) -> float:
        return self.bytes_per_vector() * 8 / self.head_dim

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [..., head_dim] float -> parts [..., width_i]."""
        return [x.to(getattr(torch, self.dtype))]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Parts [..., width_i] -> [..., head_dim] in ``dtype`` (rotated domain for rotated codecs)."""
        return parts[0].to(dtype)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        return x


class F16Codec(KVCodec):
    name, dtype = "f16", "float16"


class BF16Codec(KVCodec):
    name, dtype = "bf16", "bfloat16"


def _grouped(x: torch.Tensor) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, GROUP))  # [..., D/32, 32]


class Q8_0Codec(KVCodec):
    name = "q8_0"

    def part_specs(self):
        return [(self.head_dim, "int8"), (self.head_dim // GROUP, "float16")]

    def encode(self, x):
        g = _grouped(x)
        scale = (g.abs().amax(-1) / 127.0).to(torch.float16)
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        codes = torch.round(g * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return [codes.flatten(-2), scale]

    def decode(self, parts, dtype):
        # int8 codes times the f32 scale: type promotion converts inside the one multiply
        codes, scale = parts
        return (codes.unflatten(-1, (-1, GROUP)) * scale.to(dtype).unsqueeze(-1)).flatten(-2)


class Q4_0Codec(KVCodec):
    """llama.cpp q4_0: d = (value of largest magnitude) / -8, code = clamp(round(x / d) + 8, 0, 15)."""

    name = "q4_0"

    def part_specs(self):
        return [(self.head_dim // 2, "uint8"), (self.head_dim // GROUP, "float16")]

    def encode(self, x):
        g = _grouped(x)
        idx = g.abs().argmax(-1, keepdim=True)
        d = (g.gather(-1, idx).squeeze(-1) / -8.0).to(torch.float16)
        inv = torch.where(d != 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        codes = torch.clamp(torch.floor(g * inv.unsqueeze(-1) + 8.5), 0, 15).to(torch.uint8).flatten(-2)
        return [pack_bits(codes, 4), d]

    def decode(self, parts, dtype):
        packed, d = parts
        codes = (unpack_nibbles(packed) - 8).view(torch.int8)  # uint8 wraps: 0..7 -> -8..-1 as int8
        return (codes.unflatten(-1, (-1, GROUP)) * d.to(dtype).unsqueeze(-1)).flatten(-2)


class FP8Codec(KVCodec):
    """e4m3 codes with one f16 scale per head-vector (amax maps to 448, e4m3's largest value)."""

    name = "fp8"

    def part_specs(self):
        return [(self.head_dim, "uint8"), (1, "float16")]

    def encode(self, x):
        x = x.float()
        scale = (x.abs().amax(-1, keepdim=True) / 448.0).to(torch.float16)
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        codes = (x * inv).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        return [codes, scale]

    def decode(self, parts, dtype):
        codes, scale = parts
        return codes.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype)

    def code_table(self) -> np.ndarray:
        """The f32 value of each of the 256 e4m3 codes (for kernels that decode by lookup): sign, 4 exponent
        bits (bias 7, 0: subnormal), 3 mantissa bits; S.1111.111 is NaN (e4m3fn has no infinities)."""
        code = np.arange(256)
        exponent, mantissa = (code >> 3) & 15, (code & 7).astype(np.float64)
        magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6,
                             (1 + mantissa / 8) * 2.0 ** (exponent - 7))
        magnitude[(code & 0x7F) == 0x7F] = np.nan
        return np.where(code >> 7, -magnitude, magnitude).astype(np.float32)


# --- rotated low-bit codecs -----------------------------------------------------------------------


@cache
def lloyd_max_codebook(bits: int, iterations: int = 200) -> np.ndarray:
    """Optimal ``2**bits`` reconstruction levels (f32) for a standard normal variable (Lloyd's algorithm
    on the exact Gaussian density, in float64): the MSE-optimal scalar quantizer for rotated coordinates."""
    n = 2**bits
    levels = np.linspace(-2.5, 2.5, n, dtype=np.float64) * (1 if bits > 1 else 0.4)
    erf = np.vectorize(math.erf, otypes=[np.float64])
    for _ in range(iterations):
        edges = np.concatenate([[-math.inf], (levels[1:] + levels[:-1]) / 2, [math.inf]])
        cdf = 0.5 * (1 + erf(edges / math.sqrt(2)))
        pdf = np.exp(-(edges**2) / 2 - math.log(math.sqrt(2 * math.pi)))
        mass = np.maximum(cdf[1:] - cdf[:-1], 1e-30)
        levels = (pdf[:-1] - pdf[1:]) / mass  # E[X | X in cell]
    return levels.astype(np.float32)


def hadamard(n: int) -> torch.Tensor:
    assert n & (n - 1) == 0, "head_dim must be a power of two for the rotated codecs"
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


DEFAULT_SEED = 0x5EED
# hadamard_signs(D) of the head sizes models have, as torch's generator first drew them (bit i of the
# little-endian bytes set: +1), so that a cache's rotation needs no torch (tests/kv check the table)
SIGN_BITS = {
    32: "5c86f2de",
    64: "e2f60745f6b2ab7d",
    128: "89079c40a30942d83640accb5af29d65",
    256: "28e5ae044d9547d6d80ad702cfc2b4f773c5ecf0d908300f8ddbf57644a00ace",
    512: "c814614705d82b8ad8e600d1b34320447347f1d8da9d984fadce6900158b1ce30412f949624e23c11cd45984225a3c45"
         "3d80a7b78acdc93de98a6ba9dab56135",
}


def hadamard_signs(head_dim: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """The seeded random signs (f32 +-1) of ``signed_hadamard``: what the C kernels take (native/hadamard.h
    applies the rotation as a fast transform, D log D additions instead of a D x D product). Drawn by
    torch's generator seeded ``seed + head_dim``; the usual sizes read from ``SIGN_BITS``."""
    if seed == DEFAULT_SEED and head_dim in SIGN_BITS:
        bits = np.unpackbits(np.frombuffer(bytes.fromhex(SIGN_BITS[head_dim]), dtype=np.uint8),
                             bitorder="little")
    else:
        g = torch.Generator().manual_seed(seed + head_dim)
        bits = torch.randint(0, 2, (head_dim,), generator=g).numpy()
    return bits.astype(np.float32) * 2 - 1


def signed_hadamard(signs: ArrayLike) -> torch.Tensor:
    """R with x @ R = H (signs * x): a Walsh-Hadamard transform after the signs (``hadamard_signs``),
    orthogonal."""
    signs = torch.as_tensor(np.asarray(signs, dtype=np.float32))
    return signs[:, None] * hadamard(signs.shape[0])


class RotatedKeys(KVCodec):
    """A block codec (q8_0, q4_0) applied to keys rotated by ``signed_hadamard``: an outlier channel,
    which would set the step of its whole group of 32, is spread over all D coordinates. Stored codes and
    their layout are the base codec's; attention scores with the query rotated alike (q.k = Rq.Rk).
    Values are not rotated: their errors average out in the weighted sum (measured: q8_0 values cost
    Qwen2.5 a KLD of 0.00002, its keys 0.022)."""

    rotated = True

    def __init__(self, base: KVCodec) -> None:
        super().__init__(base.head_dim)
        self.base, self.name = base, base.name
        self.signs = hadamard_signs(base.head_dim)  # what the C kernels take
        self._matrices: dict[tuple, torch.Tensor] = {}

    @cached_property
    def matrix(self) -> torch.Tensor:
        """The rotation as a matrix, for torch code (the kernels take ``signs``)."""
        return signed_hadamard(self.signs)

    def _matrix(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.device, x.dtype)
        if key not in self._matrices:
            self._matrices[key] = self.matrix.to(x.device, x.dtype)
        return self._matrices[key]

    def part_specs(self):
        return self.base.part_specs()

    def rotate(self, x):
        return x @ self._matrix(x)

    def unrotate(self, x):
        return x @ self._matrix(x).T

    def encode(self, x):
        x = x.float()
        return self.base.encode(x @ self._matrix(x))

    def decode(self, parts, dtype):
        return self.base.decode(parts, dtype)


class RotatedCodec(KVCodec):
    """Random-sign Hadamard rotation, Lloyd-Max indices per coordinate, one f16 norm per vector.

    The stored norm is corrected so that the decoded vector has exactly the input's norm:
    ``norm = |x| / |codebook[idx]|`` (MSE-optimal direction, unbiased length)."""

    rotated = True

    def __init__(self, head_dim: int, bits: int, seed: int = 0x5EED) -> None:
        super().__init__(head_dim)
        self.bits = bits
        self.name = f"tq{bits}"
        self.signs = hadamard_signs(head_dim, seed)  # what the C kernels take
        self.codebook = lloyd_max_codebook(bits) / np.float32(math.sqrt(head_dim))  # f32
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._byte_tables: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> [256, codes per byte]

    @cached_property
    def matrix(self) -> torch.Tensor:
        """x @ matrix = H (signs * x), for torch code (the kernels take ``signs``)."""
        return signed_hadamard(self.signs)

    def _tensors(self, device, dtype):
        key = (device, dtype)
        if key not in self._cache:
            cb = torch.from_numpy(self.codebook).to(device)
            self._cache[key] = (self.matrix.to(device, dtype), cb, (cb[1:] + cb[:-1]) / 2)
        return self._cache[key]

    def part_specs(self):
        return [(self.head_dim * self.bits // 8, "uint8"), (1, "float16")]

    def rotate(self, x):
        return x @ self._tensors(x.device, x.dtype)[0]

    def unrotate(self, x):
        return x @ self._tensors(x.device, x.dtype)[0].T

    def encode(self, x):
        x = x.float()
        matrix, codebook, edges = self._tensors(x.device, torch.float32)
        y = x @ matrix
        norm = y.norm(dim=-1, keepdim=True)
        unit = y / norm.clamp_min(1e-30)
        idx = torch.bucketize(unit, edges)
        recon_norm = codebook[idx].norm(dim=-1, keepdim=True)
        scale = (norm / recon_norm.clamp_min(1e-30)).to(torch.float16)
        return [pack_bits(idx.to(torch.uint8), self.bits), scale]

    def decode(self, parts, dtype):
        packed, scale = parts
        return self._values(packed, dtype) * scale.to(dtype)

    def code_table(self) -> np.ndarray:
        """For kernels that decode by lookup (f32): 2-/4-bit codes -> [256, codes per byte] values of each
        byte; 3-bit codes -> the 8 levels (unit-norm domain, times the stored norm)."""
        if 8 % self.bits:
            return self.codebook
        byte = np.arange(256)[:, None]
        shifts = np.arange(8 // self.bits) * self.bits
        return self.codebook[(byte >> shifts) & ((1 << self.bits) - 1)]

    def _byte_table(self, device, dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._byte_tables:
            per_byte = 8 // self.bits
            codebook = self._tensors(device, torch.float32)[1].to(dtype)
            byte = torch.arange(256, device=device)[:, None]
            shifts = torch.arange(per_byte, device=device) * self.bits
            self._byte_tables[key] = codebook[(byte >> shifts) & ((1 << self.bits) - 1)]
        return self._byte_tables[key]

    def _values(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Codebook values of the packed codes, [..., head_dim]. A decode step at 4K context unpacks
        ~800K codes per layer: a 2- or 4-bit byte goes through a 256-entry table of its codebook
        values in one lookup, 3-bit codes are cut from 24-bit words (the bit-plane ``unpack_bits``
        took 1.6 tok/s at 4K)."""
        per_byte = 8 // self.bits if 8 % self.bits == 0 else 0
        codebook = self._tensors(packed.device, torch.float32)[1]
        if per_byte:
            table = self._byte_table(packed.device, dtype)
            return table.index_select(0, packed.flatten().int()).view(*packed.shape[:-1], self.head_dim)
        words = packed.unflatten(-1, (-1, self.bits)).int()  # 8 codes in `bits` little-endian bytes
        byte_shifts = 8 * torch.arange(self.bits, device=packed.device, dtype=torch.int32)
        word = (words << byte_shifts).sum(-1, dtype=torch.int32)
        shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * self.bits
        codes = (word.unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)
        return codebook.to(dtype).index_select(0, codes.flatten()).view(*packed.shape[:-1], self.head_dim)


# --- bit packing ----------------------------------------------------------------------------------


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., n] uint8 values < 2**bits -> [..., n * bits / 8] uint8 (little-endian bit order)."""
    n = codes.shape[-1]
    assert (n * bits) % 8 == 0
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    bit_planes = (codes.unsqueeze(-1) >> shifts) & 1  # [..., n, bits]
    flat = bit_planes.flatten(-2).unflatten(-1, (-1, 8))  # [..., n * bits / 8, 8]
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.uint8)
    return (flat * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: [..., n * bits / 8] uint8 -> [..., n] uint8."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bit_stream = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [..., n * bits]
    planes = bit_stream.unflatten(-1, (n, bits)).to(torch.int32)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (planes * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``unpack_bits(packed, 4, n)`` in two byte ops, low nibble first: a decode step at 4K context
    with q4_0 KV went from 1.9 tok/s through the bit planes to 8.7 tok/s (f16 KV: 17.2)."""
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


# --- registry -------------------------------------------------------------------------------------

_SIMPLE = {c.name: c for c in (KVCodec, F16Codec, BF16Codec, Q8_0Codec, Q4_0Codec, FP8Codec)}
CACHE_TYPES = tuple(KV_TYPES)


def make_codec(name: str, head_dim: int, keys: bool = False) -> KVCodec:
    """The codec of a KV type (``cache_types.KV_TYPES`` states its exact storage cost); ``keys``: the
    codec of the K side, which rotates q8_0 and q4_0 keys."""
    spec = kv_type(name)
    spec.check(head_dim)
    codec = RotatedCodec(head_dim, spec.code_bits) if spec.rotated else _SIMPLE[name](head_dim)
    if keys and keys_rotated(name, head_dim) and not spec.rotated:
        codec = RotatedKeys(codec)
    assert codec.bytes_per_vector() == spec.bytes_per_vector(head_dim), (
        f"{name} layout disagrees with KV_TYPES"
    )
    return codec
