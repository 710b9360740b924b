"""KV cache types and their exact storage cost, the one table the planner and the codecs share.

Each K or V *head-vector* (``head_dim`` = D elements of one token in one KV head) is stored as
codes plus, for the quantized types, scales or norms:

    type   codes        scales / norms                       bits per element       D=64   D=128  D=256
    f32    D x 32 bit   -                                    32                     32     32     32
    f16    D x 16 bit   -                                    16                     16     16     16
    bf16   D x 16 bit   -                                    16                     16     16     16
    q8_0   D x 8 bit    one f16 per 32 elements (llama.cpp)  8 + 16/32  = 8.5       8.5    8.5    8.5
    q4_0   D x 4 bit    one f16 per 32 elements (llama.cpp)  4 + 16/32  = 4.5       4.5    4.5    4.5
    fp8    D x e4m3     one f16 scale per head-vector        8 + 16/D               8.25   8.125  8.0625
    tq4    D x 4 bit    one f16 norm per head-vector         4 + 16/D               4.25   4.125  4.0625
    tq3    D x 3 bit    one f16 norm per head-vector         3 + 16/D               3.25   3.125  3.0625
    tq2    D x 2 bit    one f16 norm per head-vector         2 + 16/D               2.25   2.125  2.0625

fp8 keeps one *f16* scale per token per KV head (amax / 448 fits f16 easily), the layout of the
engine's codec in ``kvserve/kv/codecs.py``; an f32 scale would cost 8 + 32/D bits.
tq2/3/4 are rotated codecs (random-sign Hadamard rotation, Lloyd-Max codes, one norm per vector).

KV bytes per token = layers x kv_heads x (bytes of a K head-vector + bytes of a V head-vector),
which for one type is 2 x layers x kv_heads x D x bits / 8. No torch here: bookkeeping and the
planner import this module; codecs can check their layouts against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig

GROUP = 32  # elements per scale of the llama.cpp block types q8_0 and q4_0


@dataclass(frozen=True, slots=True)
class KVType:
    name: str
    description: str
    code_bits: int  # bits of each element's code
    scale_bits: int = 0  # bits of each scale (or norm)
    scale_group: int | None = None  # elements sharing one scale; None: one per head-vector
    rotated: bool = False
    torch_dtype: str | None = None  # the plain torch element type, for the unquantized types

    def check(self, head_dim: int) -> None:
        """Raise ValueError when this type cannot store head-vectors of ``head_dim`` elements."""
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        if self.scale_group and head_dim % self.scale_group:
            raise ValueError(
                f"KV cache type {self.name} needs head_dim divisible by {self.scale_group}; "
                f"this model has {head_dim}"
            )
        if self.rotated and head_dim & (head_dim - 1):
            raise ValueError(
                f"KV cache type {self.name} needs a power-of-two head_dim; this model has {head_dim}"
            )
        if (head_dim * self.code_bits) % 8:
            raise ValueError(
                f"KV cache type {self.name} cannot pack {head_dim} x {self.code_bits} bits into bytes"
            )

    def bytes_per_vector(self, head_dim: int) -> int:
        """Exact bytes of one head-vector: codes plus its scales."""
        self.check(head_dim)
        num_scales = 0
        if self.scale_bits:
            num_scales = head_dim // self.scale_group if self.scale_group else 1
        return (head_dim * self.code_bits + num_scales * self.scale_bits) // 8

    def bits_per_element(self, head_dim: int) -> float:
        """Bits per stored element, scales included (8.5 for q8_0, 3 + 16/head_dim for tq3)."""
        return self.bytes_per_vector(head_dim) * 8 / head_dim


KV_TYPES: dict[str, KVType] = {
    t.name: t
    for t in (
        KVType("f32", "32-bit float", 32, torch_dtype="float32"),
        KVType("f16", "16-bit float", 16, torch_dtype="float16"),
        KVType("bf16", "bfloat16", 16, torch_dtype="bfloat16"),
        KVType("q8_0", "8-bit codes, one f16 scale per 32 elements (llama.cpp q8_0)", 8, 16, GROUP),
        KVType("q4_0", "4-bit codes, one f16 scale per 32 elements (llama.cpp q4_0)", 4, 16, GROUP),
        KVType("fp8", "float8 e4m3 codes, one f16 scale per head-vector", 8, 16),
        KVType("tq4", "rotated 4-bit Lloyd-Max codes, one f16 norm per head-vector", 4, 16, rotated=True),
        KVType("tq3", "rotated 3-bit Lloyd-Max codes, one f16 norm per head-vector", 3, 16, rotated=True),
        KVType("tq2", "rotated 2-bit Lloyd-Max codes, one f16 norm per head-vector", 2, 16, rotated=True),
    )
}


# Block types whose keys are stored rotated (kv/codecs.py RotatedKeys) where head_dim is a power of two.
ROTATED_KEYS = ("q8_0", "q4_0")


def keys_rotated(name: str, head_dim: int) -> bool:
    """Whether keys of this type are stored rotated, so attention rotates each query."""
    return kv_type(name).rotated or (name in ROTATED_KEYS and head_dim & (head_dim - 1) == 0)


def kv_type(name: str) -> KVType:
    try:
        return KV_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name!r}; choose one of {', '.join(KV_TYPES)}") from None


def kv_pair(name: str) -> tuple[str, str]:
    """"q4_0/tq2" -> (K type, V type); a single name is both. Each side checked (``kv_type``)."""
    k, _, v = name.strip().partition("/")
    k, v = k.strip(), (v or k).strip()
    kv_type(k), kv_type(v)
    return k, v


def kv_bytes_per_token_per_layer(
    config: ModelConfig, cache_type_k: str, cache_type_v: str | None = None
) -> int:
    """K plus V bytes of one token in one layer: kv_heads x (K head-vector + V head-vector)."""
    k = kv_type(cache_type_k).bytes_per_vector(config.head_dim)
    v = kv_type(cache_type_v or cache_type_k).bytes_per_vector(config.head_dim)
    return config.num_kv_heads * (k + v)


def kv_bytes_per_token(config: ModelConfig, cache_type_k: str, cache_type_v: str | None = None) -> int:
    """K plus V bytes of one token over all layers (every layer keeping every token). ``cache_type_k`` may
    name a pair ("q4_0/tq2") when ``cache_type_v`` is not given."""
    if cache_type_v is None and "/" in cache_type_k:
        cache_type_k, cache_type_v = kv_pair(cache_type_k)
    return config.num_layers * kv_bytes_per_token_per_layer(config, cache_type_k, cache_type_v)


def pool_num_blocks(num_ctx: int, max_num_seqs: int, block_size: int) -> int:
    """Blocks of the engine's pool sized by context: ceil(num_ctx / block_size) per sequence."""
    return -(-num_ctx // block_size) * max_num_seqs


def pool_bytes(
    config: ModelConfig, num_ctx: int, max_num_seqs: int, block_size: int, cache_type_k: str,
    cache_type_v: str | None = None,
) -> int:
    """Bytes the engine allocates for ``max_num_seqs`` sequences of ``num_ctx`` tokens."""
    return pool_num_blocks(num_ctx, max_num_seqs, block_size) * block_size * kv_bytes_per_token(
        config, cache_type_k, cache_type_v)
