"""Paged K/V storage: per layer, K and V each as codec parts, head-major
``[num_kv_heads, num_blocks, block_size, width]``.

Written through a slot mapping (flat slot = block_id * block_size + offset), read through block
tables. Head-major blocks make a sequence's keys of one head one contiguous run after the gather,
so attention reads ``[kv_heads, tokens, head_dim]`` without a transpose; the gather itself is one
``index_select`` of whole blocks (rows of a 2-D view), which on CPU is a memcpy per block (advanced
indexing was 14x slower, measured). K and V may use different codecs (``--cache-type-k`` /
``--cache-type-v``); the element type is a property of the storage only, bookkeeping never sees it.

Quantized keys may be stored *centred*: minus a fixed vector per layer and KV head (``key_centres``,
``DecoderLM.key_centres``: a K bias on the RoPE pairs that barely turn). Every score of a query then moves
by the same q . centre, which softmax ignores, so attention is unchanged; what changes is that a bias of
~145 (Qwen2.5, layer 0) no longer sets the quantization step of its group. They may also be stored
*balanced*: times a vector per layer and KV head (``key_balance``, ``DecoderLM.key_balance``), the queries
divided by it (``query``), so every score is unchanged while the coordinates a query weighs most get
most of the codes' precision. q8_0/q4_0 keys are then rotated (``codecs.RotatedKeys``).

With ``window_layers`` (sliding-window layers, see ``kv.groups``) those layers' tensors have
``num_window_blocks`` blocks of their own: a second group with its own block ids, tables and slots.
Group 0 is every other layer (all layers without a window group). Each call that takes block ids or
slots takes the group they belong to.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Union

import numpy as np

from kvserve.config import ModelConfig
from kvserve.host_memory import arena, array_arena
from kvserve.kv.cache_types import kv_type
from kvserve.kv.codecs import KVCodec, make_codec
from kvserve.lazy_torch import Device, as_numpy, torch


@dataclass(frozen=True, slots=True)
class BlockRows:
    """Block tables turned into rows of the head-major pools, and the shape they read back as."""

    rows: torch.Tensor
    shape: tuple[int, ...]


UNCENTRED_KEYS = ("f32", "f16", "bf16")
# a stored part's element type -> the numpy type that holds its bits on the CPU (numpy has no bf16)
_HOST_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8,
                "uint8": np.uint8}


Vector = Union[np.ndarray, "torch.Tensor"]  # a layer's key centres or balance [kv_heads, head_dim]


def _vector(v: Vector, device: Device) -> Vector:
    """``v`` as f32, contiguous: numpy on the CPU, a tensor on another device."""
    if device.type == "cpu":
        return np.ascontiguousarray(as_numpy(v), dtype=np.float32)
    return torch.as_tensor(v).float().to(device).contiguous()


def _nbytes(part: np.ndarray | torch.Tensor) -> int:
    return part.nbytes if isinstance(part, np.ndarray) else part.numel() * part.element_size()


class PagedKVStorage:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        cache_type: str,
        device: torch.device,
        cache_type_v: str | None = None,
        window_layers: frozenset[int] = frozenset(),
        num_window_blocks: int = 0,
        key_centres: list[Vector | None] | None = None,
        key_balance: list[Vector | None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = heads = config.num_kv_heads
        self.k_codec: KVCodec = make_codec(cache_type, config.head_dim, keys=True)
        self.v_codec: KVCodec = make_codec(cache_type_v or cache_type, config.head_dim)
        # per layer [kv_heads, head_dim] f32 or None: kept only for quantized keys (f16 keys stay exact),
        # numpy on the CPU (the C writer and attention read them), tensors on the device
        quantized = self.k_codec.name not in UNCENTRED_KEYS
        def per_layer(vectors):
            return [None if c is None else _vector(c, device)
                    for c in vectors] if vectors and quantized else [None] * config.num_layers

        self.k_centres = per_layer(key_centres)
        self.k_balance = per_layer(key_balance)  # keys stored times it, queries times its inverse:
        self.q_balance = [None if b is None else _vector(1 / b, device) for b in self.k_balance]
        if window_layers and num_window_blocks < 1:
            raise ValueError("a window group needs at least one block")
        self.window_layers = frozenset(window_layers)
        self.kv_group_of_layer = [int(i in self.window_layers) for i in range(config.num_layers)]
        self.kv_group_blocks = [num_blocks, num_window_blocks] if window_layers else [num_blocks]

        # every part of every layer in one arena (2 MiB pages on a Linux CPU: kvserve.host_memory); on the
        # CPU numpy arrays, which the C kernels read (``k_arrays``), seen by the torch path through tensor
        # views made the first time it asks (``k``, ``v``)
        def specs(codec: KVCodec, blocks: int) -> list:
            return [((heads, blocks, block_size, w), d) for w, d in codec.part_specs()]

        layer_specs = [
            specs(self.k_codec, self.kv_group_blocks[g]) + specs(self.v_codec, self.kv_group_blocks[g])
                       for g in self.kv_group_of_layer]
        self.device = device
        self._num_k_parts = len(self.k_codec.part_specs())
        flat = [spec for layer in layer_specs for spec in layer]
        self._part_names = [d for _, d in flat]
        self.k_arrays: list[list[np.ndarray]] | None = None
        self.v_arrays: list[list[np.ndarray]] | None = None
        self._k: list[list[torch.Tensor]] | None = None
        self._v: list[list[torch.Tensor]] | None = None
        if device.type == "cpu":
            arrays = array_arena([(shape, _HOST_DTYPES[name]) for (shape, _), name in zip(
                flat, self._part_names, strict=True)])
            self.k_arrays, self.v_arrays = self._by_layer(arrays, layer_specs)
        else:
            self._k, self._v = self._by_layer(
                arena([(shape, getattr(torch, d)) for shape, d in flat], device), layer_specs)
        self._kv_group_offsets_np = [np.arange(heads, dtype=np.int64)[:, None] * n
                                     for n in self.kv_group_blocks]

    def _by_layer(self, parts: list, layer_specs: list) -> tuple[list[list], list[list]]:
        """Each layer's parts split into K's and V's."""
        parts, k, v = iter(parts), [], []
        for layer in layer_specs:
            mine = [next(parts) for _ in layer]
            k.append(mine[: self._num_k_parts])
            v.append(mine[self._num_k_parts :])
        return k, v

    @property
    def k(self) -> list[list[torch.Tensor]]:
        """Per layer, K's parts as tensors (on the CPU views of ``k_arrays``, made at the first call)."""
        if self._k is None:
            self._k, self._v = self._tensor_views()
        return self._k

    @property
    def v(self) -> list[list[torch.Tensor]]:
        if self._v is None:
            self._k, self._v = self._tensor_views()
        return self._v

    def _tensor_views(self) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        names = iter(self._part_names)  # in the arena's order: each layer's K parts, then its V parts

        def view(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).view(getattr(torch, next(names)))

        k, v = [], []
        for k_parts, v_parts in zip(self.k_arrays, self.v_arrays, strict=True):
            k.append([view(a) for a in k_parts])
            v.append([view(a) for a in v_parts])
        return k, v

    @cached_property
    def _kv_group_offsets(self) -> list[torch.Tensor]:
        """Per group, [heads, 1]: the first row of each head's blocks (the torch path's)."""
        heads_column = torch.arange(self.num_kv_heads, device=self.device)[:, None]
        return [heads_column * n for n in self.kv_group_blocks]

    def _parts(self) -> list:
        """Every layer's K and V parts as held: arrays on the CPU, tensors elsewhere."""
        k, v = (self.k_arrays, self.v_arrays) if self.k_arrays is not None else (self._k, self._v)
        return [layer_k + layer_v for layer_k, layer_v in zip(k, v, strict=True)]

    @property
    def windowed(self) -> bool:
        return len(self.kv_group_blocks) > 1

    @property
    def window_kv_group(self) -> int | None:
        """The group of the sliding-window layers (``kv.groups.WindowGroup``'s), None without one."""
        return 1 if self.windowed else None

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(p) for layer in self._parts() for p in layer)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of group 0 (every layer without a window group)."""
        return self.kv_group_bytes_per_block(0)

    def kv_group_bytes_per_block(self, kv_group: int) -> int:
        parts = self._parts()
        return sum(_nbytes(p) // self.kv_group_blocks[kv_group]
                   for layer in self.kv_group_layers(kv_group) for p in parts[layer])

    def kv_group_layers(self, kv_group: int) -> list[int]:
        return [i for i, g in enumerate(self.kv_group_of_layer) if g == kv_group]

    def layout(self) -> dict[str, object]:
        """What a block's bytes (``export_blocks``) mean: the stored parts' shapes and types, in order."""
        first = self._parts()[0]  # layer 0's parts, the first of the arena's part names
        return {
            "block_size": self.block_size,
            "kv_heads": self.num_kv_heads,
            "layers": len(self.kv_group_of_layer),
            "cache_type_k": self.k_codec.name,
            "cache_type_v": self.v_codec.name,
            "parts": [[p.shape[-1], name] for p, name in zip(first, self._part_names, strict=False)],
            "bytes_per_block": self.bytes_per_block,
        } | self._key_transform() | (
            {
                "window_layers": sorted(self.window_layers),
                "window_bytes_per_block": self.kv_group_bytes_per_block(self.window_kv_group),
            }
            if self.windowed
            else {}
        )

    def _kv_group_parts(self, kv_group: int) -> list:
        """Every part of the group's layers, K's then V's per layer: numpy on the CPU, else tensors."""
        k, v = (self.k_arrays, self.v_arrays) if self.k_arrays is not None else (self.k, self.v)
        return [p for layer in self.kv_group_layers(kv_group) for p in k[layer] + v[layer]]

    def export_blocks(self, block_ids: list[int], kv_group: int = 0) -> np.ndarray:
        """The stored bytes of whole blocks of ``kv_group``, as they are held (a q8_0 block stays q8_0): a
        host ``[len(block_ids), kv_group_bytes_per_block(group)]`` uint8 copy, layer by layer, K's parts then
        V's, each part ``[kv_heads, block_size, width]``. One gather per part, whatever the number of
        blocks."""
        if self.k_arrays is not None:
            ids = np.asarray(block_ids, dtype=np.int64)
            # gathering blocks from the block-major view writes each block's heads in order: one pass
            return np.concatenate([p.transpose(1, 0, 2, 3)[ids].view(np.uint8).reshape(len(ids), -1)
                                   for p in self._kv_group_parts(kv_group)], axis=1)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = [
            p.transpose(0, 1).index_select(0, ids).view(torch.uint8).flatten(1)
            for p in self._kv_group_parts(kv_group)
        ]
        return torch.cat(rows, dim=1).cpu().numpy()

    def import_blocks(self, block_ids: list[int], data: np.ndarray | torch.Tensor, kv_group: int = 0) -> None:
        """Store ``export_blocks``' bytes ``data`` [len(block_ids), kv_group_bytes_per_block(group)] (uint8,
        host memory) into the given blocks of ``kv_group``."""
        data = np.asarray(data)
        size = self.kv_group_bytes_per_block(kv_group)
        if data.shape != (len(block_ids), size):
            raise ValueError(f"expected {len(block_ids)} blocks of {size} bytes, got {tuple(data.shape)}")
        if self.k_arrays is None:
            self._import_to_device(block_ids, data, kv_group)
            return
        ids, offset = np.asarray(block_ids, dtype=np.int64), 0
        for p in self._kv_group_parts(kv_group):
            heads, _, bs, width = p.shape
            size = heads * bs * width * p.itemsize
            chunk = np.ascontiguousarray(data[:, offset : offset + size]).view(p.dtype)
            p[:, ids] = chunk.reshape(len(ids), heads, bs, width).transpose(1, 0, 2, 3)
            offset += size

    def _import_to_device(self, block_ids: list[int], data: np.ndarray, kv_group: int) -> None:
        device = self.device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        data = torch.from_numpy(np.ascontiguousarray(data)).to(device)
        offset = 0
        for p in self._kv_group_parts(kv_group):
            heads, _, bs, width = p.shape
            size = heads * bs * width * p.element_size()
            chunk = data[:, offset : offset + size].contiguous().view(p.dtype).view(
                len(block_ids), heads, bs, width)
            p.index_copy_(1, ids, chunk.transpose(0, 1))
            offset += size

    def slot_rows(self, slot_mapping: torch.Tensor | np.ndarray,
                  kv_group: int = 0) -> torch.Tensor | np.ndarray:
        """The flat row of each (head, token) slot of ``kv_group``: computed once per forward, used by
        every layer of the group. A numpy mapping (the one-call step's) gives numpy rows."""
        # [heads * tokens]
        if isinstance(slot_mapping, np.ndarray):
            return (self._kv_group_offsets_np[kv_group] * self.block_size + slot_mapping[None, :]).ravel()
        return (self._kv_group_offsets[kv_group] * self.block_size + slot_mapping[None, :]).flatten()

    def block_rows(self, block_tables: torch.Tensor, kv_group: int = 0) -> BlockRows:
        """The head-major block rows of ``kv_group``'s block_tables [..., n]: computed once per forward."""
        # [..., heads, n] -> block rows
        rows = (self._kv_group_offsets[kv_group] + block_tables.unsqueeze(-2)).flatten()
        shape = (*block_tables.shape[:-1], self.num_kv_heads, block_tables.shape[-1] * self.block_size, -1)
        return BlockRows(rows, shape)

    def _key_transform(self) -> dict[str, object]:
        """How keys are turned before their codes (rotated; centred and balanced in which layers): nothing
        for plain keys, so the identity of an f16 cache is what it was before keys could be either."""
        centred = [i for i, c in enumerate(self.k_centres) if c is not None]
        balanced = [i for i, b in enumerate(self.k_balance) if b is not None]
        rotated = self.k_codec.rotated and not kv_type(self.k_codec.name).rotated
        # the balance is computed by code that may change while the weights do not: its values are named
        digest = hashlib.sha256(b"".join(as_numpy(self.k_balance[i]).tobytes() for i in balanced))
        return (({"keys_rotated": True} if rotated else {}) | ({"keys_centred": centred} if centred else {})
                | ({"keys_balanced": [balanced, digest.hexdigest()[:16]]} if balanced else {}))

    def write(self, layer: int, slot_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] encoded (k centred and balanced first) and stored at
        their ``slot_rows``."""
        if self.k_centres[layer] is not None:
            k = k.float() - torch.as_tensor(self.k_centres[layer])
        if self.k_balance[layer] is not None:
            k = k.float() * torch.as_tensor(self.k_balance[layer])
        for parts, codec, x in ((self.k[layer], self.k_codec, k), (self.v[layer], self.v_codec, v)):
            for stored, encoded in zip(parts, codec.encode(x), strict=True):
                stored.view(-1, stored.shape[-1]).index_copy_(0, slot_rows,
                                                              encoded.transpose(0, 1).flatten(0, 1))

    def query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [n, heads, head_dim] as the stored keys of ``layer`` are scored: over their balance (each
        KV head's group of query heads), then rotated with rotated keys. What the C kernels do to q."""
        balance = self.q_balance[layer]
        if balance is not None:
            balance = torch.as_tensor(balance)
            n, heads, d = q.shape
            q = (q.float().view(n, self.num_kv_heads, heads // self.num_kv_heads, d) * balance[:, None]).view(
                n, heads, d).to(q.dtype)
        return self.k_codec.rotate(q)

    def _read(self, parts: list[torch.Tensor], codec: KVCodec, block_rows: BlockRows, dtype) -> torch.Tensor:
        blocks = [p.view(-1, self.block_size * p.shape[-1]).index_select(0, block_rows.rows) for p in parts]
        return codec.decode([b.view(block_rows.shape) for b in blocks], dtype)

    def read_blocks(
        self, layer: int, block_rows: BlockRows, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K and V of the given blocks: block tables [..., n] -> [..., kv_heads, n * block_size,
        head_dim], in the codec's attention domain (rotated for rotated codecs)."""
        return (self._read(self.k[layer], self.k_codec, block_rows, dtype),
                self._read(self.v[layer], self.v_codec, block_rows, dtype))

    def gather(
        self, layer: int, block_rows: BlockRows, num_tokens: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` K/V of one sequence: head-major [num_kv_heads, num_tokens, head_dim]
        (f32 unless ``dtype`` says otherwise)."""
        k, v = self.read_blocks(layer, block_rows, dtype or torch.float32)
        return k[:, :num_tokens], v[:, :num_tokens]
