"""Inputs in every weight layout and the kernel runs the instruction-set tests compare across paths."""

from __future__ import annotations

import pytest
import torch

from kvserve import native
from kvserve.models import block_layouts, layouts
from kvserve.models.weight_grids import pack_int4, pack_int8_groups16
from kvserve.native import abi
from tests.support import BLOCK_TYPES, random_blocks


def layout_inputs(m: int, n: int, k: int, seed: int, layout: str):
    """Activations, packed weights and a bias for int4_matmul's layout ``layout``: "F16" or "F32"
    (int4_inputs), or a GGUF block type (random file blocks through block_layouts.pack_blocks)."""
    if layout in ("F16", "F32"):
        return int4_inputs(m, n, k, seed, layout == "F32")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)
    x[0, :32] = 0.0
    packed = torch.from_numpy(block_layouts.pack_blocks(random_blocks(layout, n, k, seed), layout, n, k))
    return x, packed, torch.randn(n, generator=g)


def layout_code(layout: str) -> int:
    return layouts.LAYOUT_NAMES.index(layout) if layout in ("F16", "F32") else layouts.GGUF_LAYOUTS[layout][0]


def run_int4(isa: str, x, packed, bias, n: int, digits: int, threads: int,
             layout: str | bool = "F16") -> torch.Tensor:
    """layout: a name of layout_inputs (True / False: "F32" / "F16")."""
    fn = kernel("int4_matmul", "int4_matmul", isa)
    m, k = x.shape
    layout = ("F32" if layout else "F16") if isinstance(layout, bool) else layout
    y = torch.full((m, n), float("nan"))
    assert fn(x.data_ptr(), packed.data_ptr(), bias.data_ptr(), m, n, k, y.data_ptr(), threads, digits,
              layout_code(layout), 0) == 0
    return y


def run_int8(isa: str, x, packed, n: int, threads: int, name: str = "int8_matmul") -> torch.Tensor:
    fn = kernel("int8_matmul", name, isa)
    m, k = x.shape
    y = torch.full((m, n), float("nan"))
    assert fn(x.data_ptr(), packed.data_ptr(), None, m, n, k, y.data_ptr(), threads, 0) == 0
    return y


LAYOUTS = ("F16", "F32", *BLOCK_TYPES)


def layout_shapes(layout: str) -> list[tuple[int, int, int]]:
    """SHAPES, with rows of whole super-blocks (256) for the K-quants."""
    return [(m, n, 256 * (1 + i % 2)) for i, (m, n, _) in enumerate(SHAPES)] if "K" in layout else SHAPES


def grid16_inputs(m: int, n: int, k: int, seed: int):
    """A Q4_K-like grid (codes 0..15, f32 scales and offsets per 16 inputs) and activations."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // 16, generator=g) * 0.01 + 1e-4
    offsets = -torch.rand(n, k // 16, generator=g) * 0.1
    x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)
    return x, pack_int8_groups16(codes, scales, offsets)


def skip_unless_runnable(isa: str) -> None:
    if isa not in native.runnable_isas():
        pytest.skip(
            f"not run: this CPU cannot run the {isa} path (it runs {', '.join(native.runnable_isas())})")


def kernel(source: str, name: str, isa: str):
    """``name`` of ``<source>.c`` built for ``isa``, with kernels.h's signature."""
    skip_unless_runnable(isa)
    lib = native.load(source, isa)
    assert lib is not None, f"the {isa} build of {source}.c failed"
    if hasattr(lib, "simd_isa"):  # the kernels written against simd.h say which path they took
        assert abi.bind(lib,
                        "simd_isa")().decode().startswith(isa), "the build took another path than asked for"
    return abi.bind(lib, name)


def int4_inputs(m: int, n: int, k: int, seed: int, f32_scales: bool = False):
    """4-bit groups with f16 scales and offsets (QL_F16) or, f32_scales, f32 ones (QL_F32: scales and
    offsets f16 cannot hold), as pack_int4 packs them."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    lo = -torch.rand(n, k // 32, generator=g) * 0.1
    if not f32_scales:
        scale, lo = scale.half().float(), lo.half().float()
    x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)  # outliers, as real activations have
    x[0, :32] = 0.0  # an all-zero group (q4-fast's scale 0)
    return x, pack_int4(codes, scale, lo, f32_scales), torch.randn(n, generator=g)


# rows: 1 (decode), tiles of every path (4, 6, 8) and their remainders; outputs not a multiple of 16
SHAPES = [(1, 48, 64), (7, 40, 96), (13, 72, 128)]
