"""Every instruction-set path of the native kernels (native/simd.h) that this CPU runs, built here and
compared: the integer kernels give the same bits on every path as the portable C build, the float
kernels stay within their stated bounds of the torch path. A path the CPU cannot run is reported as
skipped with that reason, never passed."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvserve import native
from kvserve.models import block_layouts, layouts
from kvserve.models.weight_grids import int8_groups, pack_int4, pack_int8_groups, pack_int8_groups16
from kvserve.native import abi
from tests.support import BLOCK_TYPES, random_blocks

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")

FAST_PATHS = [isa for isa in native.ISA_FLAGS if isa != "portable"]


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


def layout_inputs(m: int, n: int, k: int, seed: int, layout: str):
    """Activations, packed weights and a bias for int4_matmul's layout ``layout``: "F16" or "F32"
    (int4_inputs), or a GGUF block type (random file blocks through block_layouts.pack_blocks)."""
    if layout in ("F16", "F32"):
        return int4_inputs(m, n, k, seed, layout == "F32")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)
    x[0, :32] = 0.0
    packed = block_layouts.pack_blocks(random_blocks(layout, n, k, seed), layout, n, k)
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


# rows: 1 (decode), tiles of every path (4, 6, 8) and their remainders; outputs not a multiple of 16
SHAPES = [(1, 48, 64), (7, 40, 96), (13, 72, 128)]
LAYOUTS = ("F16", "F32", *BLOCK_TYPES)


def layout_shapes(layout: str) -> list[tuple[int, int, int]]:
    """SHAPES, with rows of whole super-blocks (256) for the K-quants."""
    return [(m, n, 256 * (1 + i % 2)) for i, (m, n, _) in enumerate(SHAPES)] if "K" in layout else SHAPES


@pytest.mark.parametrize("isa", FAST_PATHS)
@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int4_matmul_same_bits_as_portable(isa, digits, layout):
    for seed, (m, n, k) in enumerate(layout_shapes(layout)):
        x, packed, bias = layout_inputs(m, n, k, seed, layout)
        reference = run_int4("portable", x, packed, bias, n, digits, 1, layout)
        assert torch.equal(run_int4(isa, x, packed, bias, n, digits, 2, layout), reference), (m, n, k)


@pytest.mark.parametrize("isa", FAST_PATHS)
def test_int8_head_same_bits_as_portable(isa):
    for seed, (m, n, k) in enumerate([(1, 40, 64), (9, 56, 190), (17, 33, 96)]):
        g = torch.Generator().manual_seed(seed)
        packed = pack_int8_groups(*int8_groups(torch.randn(n, k, generator=g)))
        x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)
        assert torch.equal(run_int8(isa, x, packed, n, 2), run_int8("portable", x, packed, n, 1)), (m, n, k)


def grid16_inputs(m: int, n: int, k: int, seed: int):
    """A Q4_K-like grid (codes 0..15, f32 scales and offsets per 16 inputs) and activations."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // 16, generator=g) * 0.01 + 1e-4
    offsets = -torch.rand(n, k // 16, generator=g) * 0.1
    x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)
    return x, pack_int8_groups16(codes, scales, offsets)


@pytest.mark.parametrize("isa", FAST_PATHS)
def test_int8_groups16_same_bits_as_portable(isa):
    for seed, (m, n, k) in enumerate([(1, 40, 64), (9, 56, 192), (17, 33, 96)]):
        x, packed = grid16_inputs(m, n, k, seed)
        assert torch.equal(run_int8(isa, x, packed, n, 2, "int8_matmul_g16"),
                           run_int8("portable", x, packed, n, 1, "int8_matmul_g16")), (m, n, k)


def test_portable_int4_is_the_exact_integer_arithmetic():
    """The reference the other paths are held to: two digits of each activation against the 4-bit codes,
    recomputed here in float64 from the same digits (within the f32 accumulation's rounding)."""
    x, packed, bias = int4_inputs(5, 32, 64, seed=9)
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    scale = (torch.rand(32, 2, generator=g) * 0.01 + 1e-3).half().float()
    lo = (-torch.rand(32, 2, generator=g) * 0.1).half().float()
    w = (lo[..., None] + scale[..., None] * codes.view(32, 2, 32).float()).view(32, 64)
    y = run_int4("portable", x, packed, bias, 32, 2, 1)
    exact = x.double() @ w.double().T + bias.double()
    assert float((y.double() - exact).norm() / exact.norm()) < 2e-4


def test_kvserve_isa_picks_the_build(monkeypatch):
    monkeypatch.setenv("KVSERVE_ISA", "portable")
    assert native.requested_isa() == "portable" and native.isa() == "portable"
    assert "-DKVSERVE_PORTABLE" in native.build_flags("int4_matmul", native.requested_isa())
    monkeypatch.setenv("KVSERVE_ISA", "avx3")
    with pytest.raises(ValueError,
                       match="KVSERVE_ISA='avx3': use one of native, avx512vnni, avxvnni, avx2, neon, "
                             "portable"):
        native.requested_isa()
    monkeypatch.delenv("KVSERVE_ISA")
    assert native.isa() == native.runnable_isas()[0]


def test_a_path_the_cpu_cannot_run_is_not_built(monkeypatch, caplog):
    missing = [isa for isa in native.ISA_FLAGS if isa not in native.runnable_isas()]
    if not missing:
        pytest.skip("not run: this CPU runs every path")
    native.load.cache_clear()
    try:
        assert native.load("int4_matmul", missing[0]) is None
    finally:
        native.load.cache_clear()
    assert f"KVSERVE_ISA={missing[0]}: this CPU cannot run that path" in caplog.text


@pytest.fixture
def path_build(monkeypatch):
    """Selects a path for every kernel built while the test runs (KVSERVE_ISA), and forgets the builds
    after."""

    def select(isa: str) -> None:
        skip_unless_runnable(isa)
        monkeypatch.setenv("KVSERVE_ISA", isa)
        native.load.cache_clear()
        native.function.cache_clear()

    yield select
    native.load.cache_clear()
    native.function.cache_clear()


@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
def test_attention_on_every_path_matches_the_torch_path(isa, path_build):
    """The float kernels (decode and prefill attention, whose sums each path orders its own way) within
    the bounds tests/attention holds the native build to, for the KV types read in place."""
    from tests.attention.test_native_paged import config, decode, filled_storage, prefill

    path_build(isa)
    cfg = config(heads=9, kv_heads=3)
    for cache_type in ("f32", "f16", "q8_0", "q4_0"):
        storage, tables = filled_storage(cfg, cache_type, [300, 77])
        g = torch.Generator().manual_seed(3)
        q = torch.randn(300, cfg.num_heads, cfg.head_dim, generator=g)
        ours, reference = (prefill(storage, tables[0], 300, q, 0, None, use) for use in (True, False))
        if cache_type in ("q8_0", "q4_0") and native.load("paged_attention").paged_prefill_int_keys():
            assert 1e-6 < (ours - reference).abs().max() < 2e-4  # integer keys: the int16 query's rounding
        else:
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-6)
        q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=g)
        ours, reference = (decode(storage, tables, [300, 77], q, 1, None, use) for use in (True, False))
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
def test_swiglu_on_every_path_matches_torch(isa):
    silu_mul = kernel("silu_mul", "silu_mul", isa)
    gate_up = torch.randn(5, 2 * 203, generator=torch.Generator().manual_seed(1)) * 8  # a tail past any VL
    gate_up[0, :6] = torch.tensor([-100.0, -1e-4, 0.0, -0.0, 1e-4, 100.0])
    out = torch.empty(5, 203)
    silu_mul(gate_up.data_ptr(), 5, 203, out.data_ptr())
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_clang_without_openmp_same_bits_as_gcc(isa, monkeypatch, tmp_path, caplog):
    """The integer kernels built by clang without OpenMP (as Apple's clang builds them: one thread whatever
    is asked) against this machine's gcc build with it: the same bits."""
    import shutil

    if shutil.which("clang") is None:
        pytest.skip("not run: no clang on this machine (Debian: clang)")
    x, packed, bias = int4_inputs(13, 72, 128, seed=3)
    gx, gpacked = grid16_inputs(9, 56, 192, seed=4)

    def outputs() -> list[torch.Tensor]:
        native.load.cache_clear()
        return [run_int4(isa, x, packed, bias, 72, 2, 2),
                run_int8(isa, gx, gpacked, 56, 2, "int8_matmul_g16")]

    with_gcc = outputs()
    monkeypatch.setenv("CC", "clang")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    try:
        with_clang = outputs()
    finally:
        native.load.cache_clear()
    assert list(tmp_path.rglob("int4_matmul-*.so")) and list(tmp_path.rglob("int8_matmul-*.so"))
    if "has no OpenMP" not in caplog.text:  # a clang with OpenMP here: build it without, as Apple's
        monkeypatch.setattr(native, "FLAGS", [f for f in native.FLAGS if f != "-fopenmp"])
        monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "no-openmp"))
        with_clang = outputs()
        native.load.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(with_gcc, with_clang, strict=True))


def test_portable_float_to_half_rounds_as_torch(tmp_path):
    """half.h's bit-level f32 -> f16 (what a compiler without _Float16 or F16C builds: clang 14 on x86,
    the portable path) against torch's conversion, over every exponent, ties, subnormals and overflow."""
    import subprocess

    probe = tmp_path / "probe.c"
    probe.write_text('#include "half.h"\n'
                     "void convert(const float *x, uint16_t *h, int n) { for (int i = 0; i < n; i++) h[i] = "
                     "float_to_half(x[i]); }\n")
    lib = tmp_path / "probe.so"
    subprocess.run([native.compiler(), "-O2", "-fPIC", "-shared", "-DKVSERVE_PORTABLE",
                    f"-I{native.SOURCE_DIR}", str(probe), "-o", str(lib)], check=True, capture_output=True,
                    text=True, timeout=120)
    convert = ctypes.CDLL(str(lib)).convert
    g = torch.Generator().manual_seed(0)
    bits = torch.cat([torch.randint(0, 2**31, (200_000,), generator=g, dtype=torch.int64),  # every exponent
                      # around 2^-25, f16's smallest half step
                      torch.arange(0x33000000 - 64, 0x33000000 + 64),
                      torch.arange(0x477FE000 - 64, 0x477FE000 + 64)])  # around 65520, overflow's edge
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 6.1035156e-05])])
    x = x.contiguous()
    ours = torch.empty(x.shape[0], dtype=torch.int16)
    convert(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(ours.data_ptr()), x.shape[0])
    assert torch.equal(ours, x.half().view(torch.int16))
    nan = torch.tensor([float("nan")])
    convert(ctypes.c_void_p(nan.data_ptr()), ctypes.c_void_p(ours.data_ptr()), 1)
    assert ours[0] & 0x7C00 == 0x7C00 and ours[0] & 0x3FF
