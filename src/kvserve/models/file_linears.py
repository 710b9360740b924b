"""Projections, the output head and the embedding table made straight from a GGUF file's blocks, never
through f32 weights: a load then holds the file's bytes (within 3%) and spends its time rearranging
them, not dequantizing and re-fitting grids.

    one block type with a layout (Q4_0 ... Q6_K)        Int4Linear.from_blocks: the file's codes and scales
    symmetric grids, one type or several (Q5_0 + Q8_0)  Int8GroupLinear.from_grid32: int8 codes, f16 scale per 32
    anything else (types mixed otherwise, F16, ...)     None: the f32 path of models/linear.make_linear

Only for the integer formats on the CPU in f32 (``--weights q4`` / ``q4-fast``); every part is held as the
file states it, so the model's outputs are those of the f32 path's exact grids.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvserve.models.gguf_file import SYMMETRIC_TYPES, GGUFWeights, QuantRows
from kvserve.models.linear import Int4Linear, Int8GroupLinear, Linear

FILE_FORMATS = ("q4", "q4-fast")


def applies(weights, weight_format: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this load takes projections from file blocks (a GGUF file, an integer format, CPU f32)."""
    return (isinstance(weights, GGUFWeights) and weight_format in FILE_FORMATS and device.type == "cpu"
            and dtype == torch.float32)


def projection(weights: GGUFWeights, names: list[str], bias: torch.Tensor | None, weight_format: str) -> Linear | None:
    """The tensors ``names`` stacked by rows as one projection held in the file's bits, or None."""
    types = [weights.block_type(n) for n in names]
    if Int4Linear.native() and all(types) and len({(t[0], t[2]) for t in types}) == 1:
        type_name, cols = types[0][0], types[0][2]
        rows, fast = sum(t[1] for t in types), weight_format == "q4-fast"
        return weights.packed(names, lambda raw: Int4Linear.from_blocks(raw, type_name, rows, cols, bias, fast))
    shapes = [weights.matrix(n) for n in names]
    symmetric = all(s is not None and s[0] in SYMMETRIC_TYPES and not weights.reordered(n) for s, n in zip(shapes, names))
    if not (symmetric and Int8GroupLinear.native() and len({s[2] for s in shapes}) == 1):
        return None
    if any(s[1] % 16 for s in shapes[:-1]):  # each part's rows start a panel of 16
        return None
    grids = [weights.grid32(n) for n in names]
    rows, cols = sum(g[0] for g in grids), grids[0][1]
    return Int8GroupLinear.from_grid32(rows, cols, _stacked(grids), bias)


def _stacked(grids) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The parts' (first row, codes, scales) chunks with each part's rows after the previous part's."""
    offset = 0
    for rows, _, chunks in grids:
        for r, codes, scales in chunks:
            yield offset + r, codes, scales
        offset += rows


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
