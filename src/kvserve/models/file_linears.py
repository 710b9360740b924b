"""Projections, the output head and the embedding table made straight from a GGUF file's blocks, never
through f32 weights: a load then holds the file's bytes (within 4%) and spends its time rearranging
them, not dequantizing and re-fitting grids.

    a block type with a layout (Q2_K ... Q6_K)          Int4Linear.from_blocks: the file's codes and scales
    Q8_0 (or Q5_0 / Q4_0 as a tied head)                int8_groups: int8 codes, f16 scale per 32
    a stack of parts held differently (Q4_K q, k + a    StackedLinear: each run of parts in its own layout,
      Q6_K v; Q5_0 q, k + a Q8_0 v)                     writing its columns of one output
    anything else (F16, BF16, ...)                      None: the f32 path of models/linear.make_linear

Only for the integer formats on the CPU in f32 (``--weights q4`` / ``q4-fast``; with ``int8``, only the
tied int8 head); every part is held as the file states it, so the model's outputs are those of the f32
path's exact grids. ``FileLinears`` is what a GGUF source hands the decoder's builder
(``models.decoder_weights``) for such a load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve import native
from kvserve.host_memory import packed_bytes
from kvserve.lazy_torch import Device, dtype_name, torch
from kvserve.models.layouts import INT8_SOURCES, holder, runs
from kvserve.models.linear import Int4Linear, Int8GroupLinear, Linear, StackedLinear

if TYPE_CHECKING:
    from kvserve.models.gguf_file import GGUFWeights, QuantRows

FILE_FORMATS = ("q4", "q4-fast")  # projections, head and table from the file's blocks
INT8_HEAD_FORMATS = ("int8", *FILE_FORMATS)  # a tied Q8_0 (Q5_0, Q4_0) table as the int8 head


class FileLinears:
    """The weights one load takes from a GGUF file's blocks; each method answers None where they cannot
    be (the builder then goes through f32)."""

    def __init__(self, weights: GGUFWeights, weight_format: str) -> None:
        self.weights, self.weight_format = weights, weight_format
        self.projections = weight_format in FILE_FORMATS
        # the packing arena's reservation: the worst widening (4-bit blocks as int8 groups: 2x)
        file_bytes = sum(t.num_bytes for t in weights.gf.tensors.values())
        self.arena_bytes = 2 * file_bytes if self.projections else 0

    @classmethod
    def of(cls, weights: GGUFWeights, weight_format: str, device: Device,
           dtype: str) -> FileLinears | None:
        """For a load on the CPU in f32 in an integer format; None otherwise."""
        if device.type != "cpu" or dtype_name(dtype) != "float32" or weight_format not in INT8_HEAD_FORMATS:
            return None
        return cls(weights, weight_format)

    def projection(self, names: list[str], bias: torch.Tensor | None) -> Linear | None:
        return projection(self.weights, names, bias, self.weight_format) if self.projections else None

    def tied_head(self) -> tuple[Linear, QuantRows] | None:
        return tied_head(self.weights, self.weight_format) if self.projections else None

    def table(self, name: str) -> QuantRows | None:
        """An untied embedding table kept as the file's bytes."""
        return self.weights.quant_rows(name) if self.projections else None

    def int8_head(self) -> Int8GroupLinear | None:
        """The tied head as int8 groups repacked from the file's blocks (a Q8_0, Q5_0 or Q4_0 table)."""
        return int8_groups(self.weights, ["token_embd.weight"], None)


def projection(weights: GGUFWeights, names: list[str], bias: torch.Tensor | None,
               weight_format: str) -> Linear | None:
    """The tensors ``names`` stacked by rows as one projection held in the file's bits, or None."""
    held = _projection(weights, names, bias, weight_format)
    if held is not None:
        weights.trimmer.add(held.nbytes)
    return held


def _projection(weights: GGUFWeights, names: list[str], bias: torch.Tensor | None,
                weight_format: str) -> Linear | None:
    shapes = [weights.matrix(n) for n in names]
    if any(
        s is None or weights.reordered(n) and holder(s[0], s[2]) == "int8" for s, n in zip(
            shapes, names, strict=True)):
        return None
    found = runs(shapes)
    if found is None or not Int4Linear.native() or not Int8GroupLinear.native():
        return None
    if any(kind == "int8" and any(s[1] % 16 for s in shapes[first : end - 1]) for kind, first, end in found):
        return None  # int8_groups stacks its own parts by panels of 16 rows: checked before any part is taken
    parts, first_row = [], 0
    for kind, first, end in found:
        rows = sum(s[1] for s in shapes[first:end])
        part_bias = None if bias is None else bias[first_row : first_row + rows]
        if kind == "int8":
            part = int8_groups(weights, names[first:end], part_bias)
        else:
            part = _blocks(weights, names[first:end], kind, rows, shapes[0][2], part_bias,
                           weight_format == "q4-fast")
        if part is None:
            return None
        parts.append(part)
        first_row += rows
    return parts[0] if len(parts) == 1 else StackedLinear(parts)


def _blocks(weights: GGUFWeights, names: list[str], type_name: str, rows: int, cols: int, bias,
            fast: bool) -> Int4Linear:
    return weights.packed(names, lambda raw,
                          on_rows: Int4Linear.from_blocks(raw, type_name, rows, cols, bias, fast, on_rows))


REPACK_ROWS = 4096  # rows repacked between two page drops of the mapped file


def int8_groups(weights: GGUFWeights, names: list[str], bias: torch.Tensor | None) -> Int8GroupLinear | None:
    """The tensors (Q8_0, Q5_0 or Q4_0, any mix: each an int8 code and an f16 scale per 32 as its file
    states it) stacked as int8 groups, repacked from the file's blocks (``native/block_repack.c``); None
    for other types or where the kernels cannot be built."""
    shapes = [weights.matrix(n) for n in names]
    if not all(
        s is not None and s[0] in INT8_SOURCES and not weights.reordered(n) for s, n in zip(
            shapes, names, strict=True)):
        return None  # (the int8 repack reads rows in file order: a reordered tensor goes through f32)
    repack = native.function("block_repack", "pack_gguf_int8")
    if repack is None or not Int8GroupLinear.native() or len({s[2] for s in shapes}) != 1:
        return None
    if any(s[1] % 16 for s in shapes[:-1]):  # each part's rows start a panel of 16
        return None
    rows, cols = sum(s[1] for s in shapes), shapes[0][2]
    panels, groups = -(-rows // 16), cols // 32
    out = packed_bytes(panels * groups * 544).reshape(panels, groups * 544)
    first = 0
    for name, (type_name, part_rows, _) in zip(names, shapes, strict=True):

        def pack(raw, on_rows, code=INT8_SOURCES[type_name], n=part_rows, at=first // 16, name=name) -> None:
            for r in range(0, n, REPACK_ROWS):
                count = min(REPACK_ROWS, n - r)
                if repack(raw[r:].ctypes.data, code, count, cols, out[at + r // 16].ctypes.data,
                          native.num_threads()):
                    raise ValueError(f"native repack refused {name}")
                if on_rows is not None:
                    on_rows(r + count)

        weights.packed([name], pack)
        first += part_rows
    return Int8GroupLinear.from_packed(rows, cols, out.reshape(panels, groups, 544), bias)


def tied_head(weights: GGUFWeights, weight_format: str) -> tuple[Linear, QuantRows] | None:
    """A tied embedding in one block type with a layout: the head from its blocks, and the table kept as
    the same file bytes for lookups (``QuantRows``); None otherwise."""
    found = weights.block_type("token_embd.weight")
    if found is None or weights.reordered("token_embd.weight") or not Int4Linear.native():
        return None
    type_name, rows, cols = found
    table = weights.quant_rows("token_embd.weight")
    head = Int4Linear.from_blocks(table.raw, type_name, rows, cols, None, weight_format == "q4-fast")
    return head, table
