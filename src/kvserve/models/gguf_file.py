"""Read a GGUF file: metadata into a ``ModelConfig``, tensors dequantized (with the `gguf` library) into
torch.

Tensor names stay in GGUF spelling (``token_embd.weight``, ``blk.3.attn_q.weight``); the HF loader
maps its names onto the same spelling, so the model code knows one set of names.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError
from kvserve.host_memory import HeapTrimmer
from kvserve.lazy_torch import torch
from kvserve.models import layouts
from kvserve.models.arch import ARCHS
from kvserve.models.file_linears import FileLinears
from kvserve.models.gguf_config import read_model_config  # noqa: F401  (re-exported)
from kvserve.models.gguf_header import read_gguf_header

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0",
                          "Q5_1", "Q2_K", "Q3_K")


class GGUFFile:
    """An opened GGUF file: its header (vocabulary included) and lazy tensor dequantization from a
    read-only memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.header = read_gguf_header(self.path, decode_arrays=True)
        self.tensors = self.header.tensors
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)

    def require(self, key: str) -> Any:
        return self.header.require(key)

    @property
    def architecture(self) -> str:
        return self.header.architecture

    def release(self, name: str, upto: int | None = None) -> None:
        """Drop the file's pages under a tensor the model has taken (they are read again from the page cache
        if ever needed): a load's resident size then holds one tensor of the file, not all of it read so
        far (Gemma 3 270M: 253 MB). ``upto``: only its first ``upto`` bytes (a tensor packed by parts).
        Where the OS has no madvise, nothing."""
        t = self.tensors[name]
        start = self.header.data_offset + t.offset
        page = mmap.PAGESIZE
        end = start + (t.num_bytes if upto is None else min(upto, t.num_bytes))
        first, last = -(-start // page) * page, end // page * page
        advise = getattr(getattr(self._data, "_mmap", None), "madvise", None)
        if advise is not None and last > first and hasattr(mmap, "MADV_DONTNEED"):
            advise(mmap.MADV_DONTNEED, first, last - first)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor's stored bytes, a view of the mapped file."""
        t = self.tensors[name]
        start = self.header.data_offset + t.offset
        return self._data[start : start + t.num_bytes]

    def load_tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32, in torch layout ([out, in] for matrices)."""
        return torch.from_numpy(self.load_array(name))

    def load_array(self, name: str) -> np.ndarray:
        """``load_tensor`` in numpy."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        if t.type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported type {t.type_name}")
        raw = self.tensor_bytes(name)
        shape = tuple(reversed(t.dims))  # torch order: the contiguous dimension last
        if t.type_name in ("F32", "F16"):  # a copy out of the mapped file
            array = np.array(raw.view(np.float32 if t.type_name == "F32" else np.float16), dtype=np.float32)
            return array.reshape(shape)
        # block-quantized (and BF16): rows of packed bytes for gguf.quants, a few thousand at a time (it
        # makes several temporaries the size of its input: SmolLM2's embedding at once cost ~340 MiB)
        rows = raw.reshape(-1, t.num_bytes // (t.num_elements // t.dims[0]))
        out = np.empty((rows.shape[0], t.dims[0]), dtype=np.float32)
        for r in range(0, rows.shape[0], 4096):
            out[r : r + 4096] = dequantize(rows[r : r + 4096], GGMLQuantizationType[t.type_name])
        return out.reshape(shape)


def k_quant_grid(raw: np.ndarray, rows: int, cols: int, bits: int) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_K / Q5_K blocks (256 inputs: d, dmin f16, 6-bit scales and minimums per 32, codes of 4 or 5
    bits) as their grid: codes (int8 [rows, cols]), and per 16 inputs the scale d * sc and offset
    -(dmin * m) (f32 [rows, cols / 16]; each 32-input sub-block's, twice). scale * code + offset rounds as
    the gguf library's dequantization (d * q - dm), so the grid is the file's, bit for bit."""
    from gguf.quants import Q4_K

    size = 144 if bits == 4 else 176
    blocks = raw.reshape(-1, size)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d * sc.astype(np.float32)  # [blocks, 8]: one per 32 inputs
    offset = -(dmin * m.astype(np.float32))
    qs = blocks[:, size - 128 :].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & np.uint8(0x0F)).reshape(-1, 8, 32)
    if bits == 5:  # bit j of high byte i: sub-block j's input i
        high = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        codes = codes | ((high & np.uint8(1)) << np.uint8(4))
    per16 = [torch.from_numpy(np.repeat(t, 2, axis=1).reshape(rows, cols // 16)) for t in (scale, offset)]
    return torch.from_numpy(codes.reshape(rows, cols).astype(np.int8)), per16[0], per16[1]


def affine_grid(raw: np.ndarray, rows: int, cols: int, bits: int) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 / Q5_1 blocks (d, m f16; codes of 4 or 5 bits per 32 inputs, w = d * q + m) as their grid,
    the same layout and rounding as k_quant_grid's."""
    size = 20 if bits == 4 else 24
    blocks = raw.reshape(-1, size)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].view(np.float16).astype(np.float32)
    qs = blocks[:, size - 16 :].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    codes = (qs & np.uint8(0x0F)).reshape(-1, 32)
    if bits == 5:
        high = blocks[:, 4:8].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
        codes = codes | ((high & np.uint32(1)).astype(np.uint8) << np.uint8(4))
    per16 = [torch.from_numpy(np.repeat(t, 2, axis=1).reshape(rows, cols // 16)) for t in (d, m)]
    return torch.from_numpy(codes.reshape(rows, cols).astype(np.int8)), per16[0], per16[1]


def symmetric_grid(raw: np.ndarray, rows: int, cols: int,
                   type_name: str) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """GGUF Q8_0 / Q5_0 / Q4_0 blocks (an f16 d, then 32 codes of 8, 5 or 4 bits; w = d * code) as their grid,
    decoded from the bytes 4,096 rows at a time: (first row, codes int8 [n, cols], d f32 [n, cols / 32]).
    d * code is exact in f32, so the grid gives the gguf library's dequantization back bit for bit, and
    neither the tensor in f32 nor all its codes at once are ever held (Gemma 3 270M's tied embedding:
    671 MB in f32)."""
    size = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18}[type_name]
    per_row = cols // 32
    all_blocks = raw.reshape(rows * per_row, size)
    for r in range(0, rows, 4096):
        n = min(4096, rows - r)
        blocks = all_blocks[r * per_row : (r + n) * per_row]
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        if type_name == "Q8_0":
            q = blocks[:, 2:].view(np.int8)
        else:
            qs = blocks[:, size - 16 :]
            q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)  # elements 0-15, then 16-31
            if type_name == "Q5_0":
                qh = blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
                q = q | ((qh & np.uint32(1)).astype(np.uint8) << np.uint8(4))
            q = q.astype(np.int8) - np.int8(16 if type_name == "Q5_0" else 8)
        yield r, torch.from_numpy(np.ascontiguousarray(q).reshape(n, cols)), torch.from_numpy(
            d.reshape(n, per_row))


SYMMETRIC_TYPES = ("Q8_0", "Q5_0", "Q4_0")

# the block types whose grids cannot be recovered from their values (asymmetric: scale and offset)
GRID_DECODERS = {
    "Q4_K": lambda raw, rows, cols: k_quant_grid(raw, rows, cols, 4),
    "Q5_K": lambda raw, rows, cols: k_quant_grid(raw, rows, cols, 5),
    "Q4_1": lambda raw, rows, cols: affine_grid(raw, rows, cols, 4),
    "Q5_1": lambda raw, rows, cols: affine_grid(raw, rows, cols, 5),
}


def unpermute_rope_rows(w: torch.Tensor | np.ndarray, num_heads: int) -> torch.Tensor | np.ndarray:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved -> half-split RoPE layout).

    The converter stores row (head, half, i) at (head, i, half) so that llama.cpp can rotate adjacent
    pairs. We rotate halves (like the reference implementation), so we put the rows back.
    """
    out_dim = w.shape[0]
    rest = w.shape[1:]
    half = out_dim // num_heads // 2
    if isinstance(w, np.ndarray):  # a file's rows of blocks, packed as they are
        swapped = np.swapaxes(w.reshape(num_heads, half, 2, *rest), 1, 2)
        return np.ascontiguousarray(swapped.reshape(out_dim, *rest))
    return w.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(out_dim, *rest).contiguous()


class QuantRows:
    """An embedding table held in its file's bytes (any block type the gguf library reads): a lookup
    dequantizes just the rows asked for, to the values ``load_tensor`` would give, so the f32 table
    (Qwen2.5-0.5B's: 545 MB for a 93 MB Q5_0 tensor) is never made. The bytes are the file's memory map:
    only the pages of rows looked up become resident."""

    def __init__(self, raw: np.ndarray, type_name: str, rows: int, cols: int) -> None:
        self.raw, self.type_name, self.cols = raw.reshape(rows, -1), type_name, cols
        self.nbytes = int(raw.size)

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        values = torch.from_numpy(self.row_array(ids.to(torch.int64).cpu().numpy()))
        return values if out is None else out.copy_(values)

    def row_array(self, ids: np.ndarray) -> np.ndarray:
        """f32 [len(ids), cols]: ``rows`` in numpy."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        picked = self.raw[ids]
        return dequantize(picked, GGMLQuantizationType[self.type_name]).reshape(-1, self.cols).astype(
            np.float32, copy=False)


class GGUFWeights:
    """The file's tensors by name (``rope_freqs.weight`` as ``rope_freqs``), each dequantized to f32,
    with the architecture's fix-ups, only when the model takes it: ``pop`` (the model packs it and drops
    the f32 copy before the next) or ``get``. So a load holds what the model keeps plus one f32 tensor,
    not every tensor at f32 at once (SmolLM2 with q4 weights: the load peaks ~370 MiB above the bare
    process, 1,040 before; an 8B model's f32 copies alone would be 32 GB)."""

    def __init__(self, gf: GGUFFile, config: ModelConfig,
                 on_tensor: Callable[[int, int], None] | None = None):
        self.gf, self.config, self.on_tensor = gf, config, on_tensor
        self.names = {("rope_freqs" if n == "rope_freqs.weight" else n): n for n in gf.tensors}
        self.total, self.taken = len(self.names), 0
        self.trimmer = HeapTrimmer()  # the C heap handed back as tensors are packed from their blocks

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def file_linears(self, weight_format: str, device: torch.device,
                     dtype: torch.dtype) -> FileLinears | None:
        """What takes this load's weights straight from the blocks (``models.file_linears``), if anything."""
        return FileLinears.of(self, weight_format, device, dtype)

    def pop(self, name: str) -> torch.Tensor:
        w = self._load(name)
        self.gf.release(self._take(name))
        return w

    def pop_array(self, name: str) -> np.ndarray:
        """``pop`` in numpy (f32): what the CPU runtime keeps of a vector (a norm's weights)."""
        w = self._load_array(name)
        self.gf.release(self._take(name))
        return w

    def _take(self, name: str) -> str:
        """Counts ``name`` as taken (the progress callback hears of it); returns its name in the file."""
        stored = self.names.pop(name)
        self.taken += 1
        if self.on_tensor:
            self.on_tensor(self.taken, self.total)
        return stored

    def grid16(self, name: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """The file's own grid of a tensor, for the int8 groups to hold exactly (``GRID_DECODERS``' types:
        codes, scales and offsets per 16 inputs, rows as ``pop`` gives them), decoded when called (a
        tensor that is held otherwise never is); None for other types."""
        stored = self.names[name]
        t = self.gf.tensors[stored]
        if t.type_name not in GRID_DECODERS:
            return None
        rows, cols, decode = t.num_elements // t.dims[0], t.dims[0], GRID_DECODERS[t.type_name]
        return lambda: tuple(
            self._fix_rows(name, part) for part in decode(self.gf.tensor_bytes(stored), rows, cols))

    def matrix(self, name: str) -> tuple[str, int, int] | None:
        """(type, rows, cols) of a 2-D tensor not yet taken; None for anything else."""
        stored = self.names.get(name)
        t = None if stored is None else self.gf.tensors[stored]
        return None if t is None or len(t.dims) != 2 else (t.type_name, t.dims[1], t.dims[0])

    def block_type(self, name: str) -> tuple[str, int, int] | None:
        """``matrix`` of a tensor whose file blocks ``block_layouts`` packs; None for other tensors."""
        found = self.matrix(name)
        return found if found is not None and layouts.supports(found[0], found[2]) else None

    def reordered(self, name: str) -> bool:
        """Whether the architecture reorders this tensor's rows (see ``_fix_rows``)."""
        return self._permuted(name)

    def packed(self, names: list[str],
               pack: Callable[[np.ndarray, Callable[[int], None] | None], Any]) -> Any:
        """``pack(raw, on_rows)`` of the named tensors' file bytes, stacked by rows in order ([rows, bytes per
        row], rows as ``pop`` gives them: the architecture's reordering applied), each tensor counted as taken
        and its pages dropped once packed (``on_rows(n)``, where given: the first n rows are packed): never
        dequantized."""
        stored = [self._take(name) for name in names]
        parts = []
        for name, file_name in zip(names, stored, strict=True):
            t = self.gf.tensors[file_name]
            rows = self.gf.tensor_bytes(file_name).reshape(t.dims[1], -1)
            if self._permuted(name):
                heads = self.config.num_heads if name.endswith("attn_q.weight") else self.config.num_kv_heads
                rows = unpermute_rope_rows(rows, heads)
            parts.append(rows)
        # the mapped file itself: pages dropped as rows are packed
        if len(parts) == 1 and not self._permuted(names[0]):
            row_bytes = parts[0].shape[1]
            result = pack(parts[0], lambda done: self.gf.release(stored[0], done * row_bytes))
        else:
            result = pack(np.concatenate(parts) if len(parts) > 1 else parts[0], None)
        for file_name in stored:
            self.gf.release(file_name)
        return result

    def quant_rows(self, name: str) -> QuantRows | None:
        """A quantized embedding table kept as its file's bytes (``QuantRows``), taken; None for f32/f16
        tensors, types the gguf library does not read, or rows the architecture reorders."""
        stored = self.names.get(name)
        t = None if stored is None else self.gf.tensors[stored]
        if (
            t is None
            or len(t.dims) != 2
            or t.type_name in ("F32", "F16")
            or t.type_name not in SUPPORTED_TENSOR_TYPES
        ):
            return None
        if self._permuted(name):
            return None
        self._take(name)
        return QuantRows(self.gf.tensor_bytes(stored), t.type_name, t.dims[1], t.dims[0])

    def get_array(self, name: str) -> np.ndarray | None:
        return self._load_array(name) if name in self.names else None

    def _load(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self._load_array(name))

    def _load_array(self, name: str) -> np.ndarray:
        """A tensor dequantized to f32, the architecture's fix-ups applied (a KeyError for a missing one):
        every tensor a load takes at f32 comes through here."""
        return self._fix_rows(name, self.gf.load_array(self.names[name]))

    def _permuted(self, name: str) -> bool:
        """Whether the architecture reorders this tensor's rows (the q/k RoPE permutation of llama and
        granite)."""
        return ARCHS[self.config.architecture].gguf_permuted_qk and name.endswith(
            ("attn_q.weight", "attn_k.weight"))

    def _fix_rows(self, name: str, w: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """The architecture's fix-ups of a tensor's rows (the q/k RoPE permutation of llama and granite)."""
        if self._permuted(name):
            heads = self.config.num_heads if name.endswith("attn_q.weight") else self.config.num_kv_heads
            w = unpermute_rope_rows(w, heads)
        return w
