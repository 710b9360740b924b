"""A GGUF header reader: metadata and tensor infos, without touching the weights.

``gguf.GGUFReader`` decodes every metadata array into numpy views as it opens a file (the 49k-token
SmolLM2 vocabulary takes seconds, a 262k-token Gemma vocabulary far longer). Planning needs the
scalars, a few short per-layer lists, and each tensor's shape and storage type, so this reader
walks the header once and *skips* long arrays, keeping only their element type and count:

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: string, value_type u32, value)        string = u64 length + utf-8 bytes
                 array value = element_type u32, count u64, elements
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims, ggml_type u32, offset u64)
    padding to general.alignment, then the tensor data (never read here)

It does not import torch (only ``gguf.constants``, for the ggml block and type sizes), and a 70B
file's header (128k-token vocabulary, 280k merges) reads in a fraction of a second.
"""

from __future__ import annotations

import math
import os
import struct
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvserve.errors import ModelLoadError
from kvserve.string_array import StringArray, decoded

MAX_DECODED_ARRAY = 4096  # longer arrays (vocabularies, merges, scores) are skipped, not decoded
MAX_DECODED_STRINGS = 256
_READ_SIZE = 4 << 20

# GGUF value type id -> struct format of the scalar types
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_TYPE_NAMES = {t.value: t.name for t in GGUFValueType}
# Long numeric arrays (token types, scores) decoded as an ``array.array`` of the same items: indexed,
# iterated and true or false as the list would be, at the element's own size. Bool arrays stay lists.
_PACKED = {f for f in "BbHhIifQqd" if array(f).itemsize == struct.calcsize(f)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class SkippedArray:
    """A metadata array that was stepped over: its element type and length, not its contents."""

    element_type: str
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (innermost) dimension
    type_name: str  # ggml type: "F32", "Q4_K", ...
    offset: int  # from the start of the data section
    num_elements: int
    num_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """GGUF order, like ``gguf.ReaderTensor.shape`` (``shape[1]`` of token_embd is the vocabulary)."""
        return self.dims


@dataclass(slots=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_offset: int = 0  # where tensor data starts in the (concatenated) file

    # the subset of ``GGUFFile``'s interface that config reading needs
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.metadata.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks '{key}'")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def num_weight_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors.values())

    @property
    def num_params(self) -> int:
        return sum(t.num_elements for t in self.tensors.values())

    def bytes_by_type(self) -> dict[str, int]:
        """Stored bytes per ggml type, largest first."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.type_name] = out.get(t.type_name, 0) + t.num_bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class _ChainedFile:
    """Several files read as one stream (registry models shipped as chunks, header in the first)."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = paths
        self._index = 0
        self._current: BinaryIO | None = open(paths[0], "rb")  # noqa: SIM115 (closed as the parts are read)

    def read(self, n: int) -> bytes:
        parts = []
        while n > 0 and self._current is not None:
            data = self._current.read(n)
            if data:
                parts.append(data)
                n -= len(data)
                continue
            self._current.close()
            self._index += 1
            self._current = (open(self._paths[self._index], "rb")  # noqa: SIM115 (as above)
                             if self._index < len(self._paths) else None)
        return b"".join(parts)

    def close(self) -> None:
        if self._current is not None:
            self._current.close()


class _Cursor:
    """Buffered little/big-endian reads over a stream; raises ModelLoadError at a premature end."""

    def __init__(self, stream, path: str, total_size: int) -> None:
        self.stream = stream
        self.path = path
        self.total_size = total_size
        self.buf = b""
        self.pos = 0
        self.consumed = 0  # bytes of the stream before buf[0]
        self.order = "<"
        self.decode_arrays = False  # decode long arrays too (the loader needs the vocabulary)

    @property
    def offset(self) -> int:
        return self.consumed + self.pos

    def need(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            return
        rest = self.buf[self.pos :]
        self.consumed += self.pos
        chunk = self.stream.read(max(n - len(rest), _READ_SIZE))
        self.buf, self.pos = rest + chunk, 0
        if len(self.buf) < n:
            raise ModelLoadError(
                f"{self.path}: truncated GGUF header (it ends at byte {self.offset + len(self.buf)})"
            )

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(self.order + fmt)
        self.need(size)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.unpack("Q")
        self.check_count(n, 1, "string")
        self.need(n)
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip(self, n: int) -> None:
        self.need(n)
        self.pos += n

    def check_count(self, count: int, min_size: int, what: str) -> None:
        if count * min_size > self.total_size - self.offset:
            raise ModelLoadError(
                f"{self.path}: truncated or malformed GGUF header ({what} of {count} elements at byte "
                f"{self.offset} would run past the end of the file)"
            )

    def strings(self, count: int) -> list[str] | StringArray:
        """``count`` strings: a list, decoded (300k of them in Qwen2.5's header: ~0.9 s through ``string``),
        or where the kernels walk them (NATIVE_STRINGS_FROM and more) a ``StringArray`` of their bytes."""
        spans = _string_spans() if count >= NATIVE_STRINGS_FROM else None
        if spans is not None:
            return self._walk_strings_native(spans, count, None, keep=True)
        out: list[str] = []
        self._walk_strings(count, out)
        return out

    def skip_strings(self, count: int) -> None:
        self._walk_strings(count, None)

    def _walk_strings(self, count: int, out: list[str] | None) -> None:
        """Step over ``count`` strings, decoding each into ``out`` when given: the hot loop for
        vocabularies and merges, run by the kernels' ``gguf_string_spans`` where they load."""
        spans = _string_spans() if count >= NATIVE_STRINGS_FROM else None
        if spans is not None:
            self._walk_strings_native(spans, count, out)
            return
        fmt, unpack_from = self.order + "Q", struct.unpack_from
        for _ in range(count):
            if self.pos + 8 > len(self.buf):
                self.need(8)
            n = unpack_from(fmt, self.buf, self.pos)[0]
            self.pos += 8
            if self.pos + n > len(self.buf):
                self.check_count(n, 1, "string")
                self.need(n)
            if out is not None:
                out.append(self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace"))
            self.pos += n

    def _walk_strings_native(self, spans, count: int, out: list[str] | None,
                             keep: bool = False) -> StringArray | None:
        """The loop above, a buffer at a time: the kernel finds the strings that lie whole in the buffer,
        then the buffer reads on (at least to the end of the next string). ``keep``: the strings' bytes
        as they lie (each behind its length) become a ``StringArray``."""
        import numpy as np

        starts, lengths = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        kept: list[bytes] = []
        at = 0  # bytes kept so far
        done = 0
        while done < count:
            view = np.frombuffer(self.buf, dtype=np.uint8)
            found = spans(view.ctypes.data + self.pos, len(self.buf) - self.pos, count - done,
                          int(self.order == ">"), starts[done:].ctypes.data, lengths[done:].ctypes.data)
            if found:
                end = done + found
                if out is not None:
                    out.extend(decoded(view, self.pos, starts[done:end], lengths[done:end]))
                run = int(starts[end - 1] + lengths[end - 1])
                if keep:
                    kept.append(bytes(self.buf[self.pos : self.pos + run]))
                    starts[done:end] += at
                    at += run
                self.pos += run
                done = end
                continue
            self.need(8)  # the next string does not lie whole in the buffer: read on to its end
            n = struct.unpack_from(self.order + "Q", self.buf, self.pos)[0]
            self.check_count(n, 1, "string")
            self.need(8 + n)
        return StringArray(b"".join(kept), starts, lengths) if keep else None


NATIVE_STRINGS_FROM = 4096  # below it the Python loop is as quick as loading the library


def _string_spans():
    """The kernels' gguf_string_spans, or None where they do not load (the Python loop then)."""
    from kvserve import native

    return native.function("block_repack", "gguf_string_spans")


def _read_value(cur: _Cursor, vtype: int) -> Any:
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        etype, count = cur.unpack("I"), cur.unpack("Q")
        return _read_array(cur, etype, count)

    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise ModelLoadError(
            f"{cur.path}: malformed GGUF header (unknown value type {vtype} at byte {cur.offset})"
        )
    return cur.unpack(fmt)


def _read_array(cur: _Cursor, etype: int, count: int) -> Any:
    name = _TYPE_NAMES.get(etype)
    if name is None:
        raise ModelLoadError(
            f"{cur.path}: malformed GGUF header (unknown array type {etype} at byte {cur.offset})"
        )
    if etype == _STRING:
        cur.check_count(count, 8, "string array")
        if count <= MAX_DECODED_STRINGS or cur.decode_arrays:
            return cur.strings(count)
        cur.skip_strings(count)
        return SkippedArray(name, count)
    if etype == _ARRAY:
        cur.check_count(count, 12, "nested array")
        for _ in range(count):
            _read_value(cur, _ARRAY)
        return SkippedArray(name, count)
    fmt = _SCALAR_FORMATS[etype]
    size = struct.calcsize(fmt)
    cur.check_count(count, size, "array")
    if count <= MAX_DECODED_ARRAY or cur.decode_arrays:
        cur.need(count * size)
        if count > MAX_DECODED_ARRAY and fmt in _PACKED:
            values = array(fmt)  # a vocabulary's scores: 1 MiB here, 8 MiB as a list of Python floats
            values.frombytes(cur.buf[cur.pos : cur.pos + count * size])
            if cur.order == ">":
                values.byteswap()
        else:
            values = list(struct.unpack_from(f"{cur.order}{count}{fmt}", cur.buf, cur.pos))
        cur.pos += count * size
        return values
    cur.skip(count * size)
    return SkippedArray(name, count)


def _ggml_type(cur: _Cursor, type_id: int, name: str) -> tuple[str, int, int]:
    try:
        qtype = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelLoadError(f"{cur.path}: tensor {name} has an unknown ggml type id {type_id}") from None
    return qtype.name, block_size, type_size


def _read_tensor_info(cur: _Cursor) -> TensorInfo:
    name = cur.string()
    n_dims = cur.unpack("I")
    if not 0 < n_dims <= 8:
        raise ModelLoadError(f"{cur.path}: malformed GGUF header (tensor {name} has {n_dims} dimensions)")
    dims = tuple(cur.unpack("Q") for _ in range(n_dims))
    type_name, block_size, type_size = _ggml_type(cur, cur.unpack("I"), name)
    offset = cur.unpack("Q")
    num_elements = math.prod(dims)
    if dims[0] % block_size:
        raise ModelLoadError(
            f"{cur.path}: tensor {name} ({type_name}) has {dims[0]} columns, "
            f"not a multiple of its block of {block_size}"
        )
    return TensorInfo(name, dims, type_name, offset, num_elements, num_elements // block_size * type_size)


def read_gguf_header(source: str | Path | Iterable[str | Path], decode_arrays: bool = False) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor infos. ``source`` is a path, or a list of chunk files
    that concatenate to one GGUF file. Long arrays (vocabulary, merges, scores) are skipped unless
    ``decode_arrays``. Raises ModelLoadError on anything that is not a whole GGUF."""
    paths = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
    shown = str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} chunks)"
    for p in paths:
        if not p.is_file():
            raise ModelLoadError(f"{p}: no such file")
    total = sum(os.path.getsize(p) for p in paths)
    stream = _ChainedFile(paths)
    try:
        cursor = _Cursor(stream, shown, total)
        cursor.decode_arrays = decode_arrays
        return _parse(cursor, shown, total)
    finally:
        stream.close()


def _parse(cur: _Cursor, shown: str, total: int) -> GGUFHeader:
    magic = cur.unpack("4s") if total >= 4 else b""
    if magic != b"GGUF":
        raise ModelLoadError(f"{shown}: not a GGUF file (it does not start with the GGUF magic)")
    version = cur.unpack("I")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise ModelLoadError(f"{shown}: GGUF version {version} is not supported (2 and 3 are)")
    num_tensors, num_kv = cur.unpack("Q"), cur.unpack("Q")
    cur.check_count(num_kv, 12, "metadata")
    cur.check_count(num_tensors, 24, "tensor table")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = _read_value(cur, cur.unpack("I"))
    header = GGUFHeader(shown, version, metadata)
    for _ in range(num_tensors):
        info = _read_tensor_info(cur)
        header.tensors[info.name] = info
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{shown}: invalid general.alignment {alignment!r}")
    header.data_offset = -(-cur.offset // alignment) * alignment
    end = max((t.offset + t.num_bytes for t in header.tensors.values()), default=0)
    if header.data_offset + end > total:
        raise ModelLoadError(
            f"{shown}: truncated GGUF file (tensor data needs {header.data_offset + end} bytes, "
            f"the file has {total})"
        )
    return header
