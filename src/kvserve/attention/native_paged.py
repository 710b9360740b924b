"""Attention through the C kernels of ``native/paged_attention.c``, which read the paged, possibly
quantized blocks in place instead of gathering and dequantizing every sequence's history into a
full-precision temporary each layer (what the torch path does).

    decode   one query per sequence, a batch of sequences: each (sequence, head) on a fixed grid of
             256-position partitions, so a sequence's output is the same bits alone or in any batch,
             with any thread count.
    prefill  a chunk of one sequence's queries, flash-style (online softmax over 64-key tiles): a
             query's output is the same bits whether the prompt comes whole or in chunks.

CPU only; on other devices, or where the kernel cannot be built, ``for_storage`` returns None.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from kvserve import native
from kvserve.kv.codecs import KVCodec
from kvserve.kv.storage import PagedKVStorage
from kvserve.lazy_torch import torch
from kvserve.native import abi

# codec name -> kind in paged_attention.c
KV_KIND_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "fp8": 5, "tq2": 6, "tq3": 7, "tq4": 8}
# The attention kernels' parameters for each of K and V (kernels.h: k_kind, k_codes, ...), in the order
# NativePagedAttention.layer_args holds them.
KV_PART = ("kind", "codes", "scales", "code_stride", "scale_stride", "table")


class NativePagedAttention:
    """Decode and prefill attention over one ``PagedKVStorage``; argument packs per layer built once.
    Holds the storage's tensor addresses, not the storage: it lives exactly as long as its
    ``for_storage`` entry."""

    def __init__(self, storage: PagedKVStorage, library: ctypes.CDLL) -> None:
        self.num_kv_heads, self.block_size = storage.num_kv_heads, storage.block_size
        # per layer, the blocks of its group (a head's rows start at head * num_blocks)
        self.layer_num_blocks = [storage.kv_group_blocks[g] for g in storage.kv_group_of_layer]
        self.decode_kernel = abi.bind(library, "paged_decode_attention")
        self.prefill_kernel = abi.bind(library, "paged_prefill_attention")
        self._tables = [self._table(c) for c in (storage.k_codec, storage.v_codec)]  # kept alive
        # rotated codecs: the query's rotation (keys) and the output's un-rotation (values), kept alive
        self._rotations = [rotation_signs(storage.k_codec), rotation_signs(storage.v_codec)]
        self.rotation_args = tuple(_address(m) for m in self._rotations)
        # per layer, the queries' balance (balanced keys) or 0; the storage's tensors, alive as long as it
        self.balance_args = [_address(b) for b in storage.q_balance]
        self.layer_args = [
            (*self._part(storage.k_arrays[layer], storage.k_codec, self._tables[0]),
             *self._part(storage.v_arrays[layer], storage.v_codec, self._tables[1]))
            for layer in range(len(storage.k_arrays))
        ]

    @staticmethod
    def _table(codec: KVCodec) -> np.ndarray | None:
        table = getattr(codec, "code_table", None)
        return None if table is None else np.ascontiguousarray(table(), dtype=np.float32)

    @staticmethod
    def _part(parts: list[np.ndarray], codec: KVCodec, table: np.ndarray | None) -> tuple:
        codes, scales, code_stride, scale_stride = _layout(parts)
        return (
            KV_KIND_CODES[codec.name],
            codes,
            scales,
            code_stride,
            scale_stride,
            _address(table),
        )

    @staticmethod
    def _run(kernel, what: str, q: torch.Tensor, shape: tuple, rest: tuple) -> torch.Tensor:
        """kernel(*shape, q, out, *rest, threads) with q as f32; returns out [n, heads, head_dim] in q's
        dtype."""
        qf = q.float().contiguous()
        out = torch.empty_like(qf)
        rc = kernel(*shape, qf.data_ptr(), out.data_ptr(), *rest, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"paged {what} attention: could not allocate its workspace")
        return out.to(q.dtype)

    def decode(
        self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
        window: int | None, scale: float, softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [n, heads, head_dim] (one query per sequence); block_tables [n, max_blocks] int64;
        context_lens [n] int64; softcap: scores s -> softcap * tanh(s / softcap) (Gemma 2), None for
        none. Returns [n, heads, head_dim] in q's dtype. The kernel itself balances and rotates q as
        the keys are stored and un-rotates the output of rotated values."""
        n, heads, head_dim = q.shape
        return self._run(
            self.decode_kernel, "decode", q, (n, heads, self.num_kv_heads, head_dim),
            (block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
             self.layer_num_blocks[layer], self.block_size, window or 0, scale, softcap or 0.0,
             *self.layer_args[layer], self.balance_args[layer], *self.rotation_args),
        )

    def prefill(
        self, layer: int, q: torch.Tensor, q_start: int, block_table: torch.Tensor, window: int | None,
        scale: float, softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [n, heads, head_dim], one sequence's queries at positions q_start .. q_start + n - 1 (their
        keys already stored); block_table [blocks] int64; softcap as in ``decode``. Returns
        [n, heads, head_dim] in q's dtype; rotations as in ``decode``."""
        n, heads, head_dim = q.shape
        table = block_table.contiguous()
        return self._run(
            self.prefill_kernel, "prefill", q, (n, q_start, heads, self.num_kv_heads, head_dim),
            (table.data_ptr(), self.layer_num_blocks[layer], self.block_size, window or 0, scale,
             softcap or 0.0, *self.layer_args[layer], self.balance_args[layer], *self.rotation_args),
        )


WRITABLE = ("f32", "f16", "bf16", "q8_0", "q4_0", "tq2", "tq3", "tq4")


class NativeKVWrite:
    """Encodes and stores this step's k/v in one C pass (``native/kv_write.c``) for the codecs it
    knows (all but fp8): f32 to q4_0 the same codes as the codec's torch ``encode``, tq2-4 and rotated
    q8_0/q4_0 keys the same steps (rotation sums in another order: a coordinate at a rounding or bucket
    edge may round to its neighbour); keys centred and balanced first where the storage says so.
    Others keep ``PagedKVStorage.write``."""

    def __init__(self, storage: PagedKVStorage, library: ctypes.CDLL) -> None:
        self.storage = weakref.ref(storage)  # not the storage: the entry must not keep its key alive
        self.kernel = abi.bind(library, "kv_write")
        self._tables = [self._rotation(c) for c in (storage.k_codec, storage.v_codec)]  # kept alive
        # per layer, K's and V's (kind, codes, code_stride, scales, scale_stride, rotation, levels, centre,
        # balance)
        self.layer_args = [
            [self._part(parts, codec, tables, centre, balance) for parts, codec, tables, centre, balance in
             ((storage.k_arrays[layer], storage.k_codec, self._tables[0], storage.k_centres[layer],
               storage.k_balance[layer]),
              (storage.v_arrays[layer], storage.v_codec, self._tables[1], None, None))]
            for layer in range(len(storage.k_arrays))
        ]

    @staticmethod
    def _rotation(codec: KVCodec) -> tuple[np.ndarray, np.ndarray | None] | None:
        """A rotated codec's signs and codebook (None for rotated q8_0/q4_0 keys) as the writer takes them
        (f32, contiguous)."""
        if not codec.rotated:
            return None
        codebook = getattr(codec, "codebook", None)
        return rotation_signs(codec), None if codebook is None else np.ascontiguousarray(codebook,
                                                                                         dtype=np.float32)

    @staticmethod
    def _part(parts: list[np.ndarray], codec: KVCodec, tables: tuple | None,
              centre: np.ndarray | None, balance: np.ndarray | None) -> tuple | None:
        if codec.name not in WRITABLE:
            return None
        codes, scales, code_stride, scale_stride = _layout(parts)
        rotation, levels = (_address(t) for t in tables) if tables else (0, 0)
        return (KV_KIND_CODES[codec.name], codes, code_stride, scales, scale_stride, rotation, levels,
                _address(centre), _address(balance))

    def __call__(self, layer: int, slot_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_args, v_args = self.layer_args[layer]
        if k_args is None or v_args is None:
            return self.storage().write(layer, slot_rows, k, v)
        tokens, heads, head_dim = k.shape
        for x, (kind, codes, code_stride, scales, scale_stride, rotation, levels, centre, balance) in (
            (k, k_args), (v, v_args)):
            x = x.float().contiguous()
            self.kernel(kind, x.data_ptr(), tokens, heads, head_dim, slot_rows.data_ptr(), codes, code_stride,
                        scales, scale_stride, rotation, levels, centre, balance)


def rotation_signs(codec: KVCodec) -> np.ndarray | None:
    """A rotated codec's rotation as the kernels take it: the D signs of its signed Hadamard matrix
    (native/hadamard.h rotates with them, and un-rotates where the kernel's parameter says so), f32,
    contiguous; None for other codecs."""
    if not codec.rotated:
        return None
    return np.ascontiguousarray(codec.signs, dtype=np.float32)


def _address(array: np.ndarray | None) -> int:
    """A host array's address for a kernel, 0 for none."""
    return 0 if array is None else array.ctypes.data


def _layout(parts: list[np.ndarray]) -> tuple[int, int, int, int]:
    """A layer's codec parts (the storage's arrays) as the kernels take them: codes and scales addresses
    (0: no scales), and bytes per head-vector in each."""
    assert all(p.flags.c_contiguous for p in parts)
    codes, scales = parts[0], parts[1] if len(parts) > 1 else None
    if scales is None:
        return codes.ctypes.data, 0, codes.shape[-1] * codes.itemsize, 0
    return (codes.ctypes.data, scales.ctypes.data, codes.shape[-1] * codes.itemsize,
            scales.shape[-1] * scales.itemsize)


_BY_STORAGE: weakref.WeakKeyDictionary[PagedKVStorage,
                                       NativePagedAttention | None] = weakref.WeakKeyDictionary()
_WRITERS: weakref.WeakKeyDictionary[PagedKVStorage, NativeKVWrite | None] = weakref.WeakKeyDictionary()


def writer_for_storage(storage: PagedKVStorage):
    """A callable ``(layer, slot_rows, k, v)`` that stores k/v: the C writer on CPU, else
    ``storage.write``."""
    if storage not in _WRITERS:
        library = native.load("kv_write") if storage.k_arrays is not None else None
        _WRITERS[storage] = None if library is None else NativeKVWrite(storage, library)
    return _WRITERS[storage] or storage.write


def for_storage(storage: PagedKVStorage) -> NativePagedAttention | None:
    """The kernel for this storage, or None (not on CPU, a codec it does not know, no compiler)."""
    if storage not in _BY_STORAGE:
        kernel = None
        codecs_known = all(c.name in KV_KIND_CODES for c in (storage.k_codec, storage.v_codec))
        if storage.k_arrays is not None and codecs_known:
            library = native.load("paged_attention")
            kernel = None if library is None else NativePagedAttention(storage, library)
        _BY_STORAGE[storage] = kernel
    return _BY_STORAGE[storage]
