"""Every instruction-set path of the native kernels (native/simd.h) that this CPU runs, built here and
compared: the integer kernels give the same bits on every path as the portable C build, the float
kernels stay within their stated bounds of the torch path. A path the CPU cannot run is reported as
skipped with that reason, never passed."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvserve import native
from kvserve.models.weight_grids import int8_groups, pack_int8_groups
from tests.native.isa_cases import (
    LAYOUTS,
    grid16_inputs,
    int4_inputs,
    kernel,
    layout_inputs,
    layout_shapes,
    run_int4,
    run_int8,
)

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")

FAST_PATHS = [isa for isa in native.ISA_FLAGS if isa != "portable"]


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


@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
def test_attention_on_every_path_matches_the_torch_path(isa, path_build):
    """The float kernels (decode and prefill attention, whose sums each path orders its own way) within
    the bounds tests/attention holds the native build to, for the KV types read in place and the rotated
    codes (tq*) decoded a vector at a time."""
    from tests.attention.paged_cases import config, decode, filled_storage, prefill, prefill_int_keys

    path_build(isa)
    cfg = config(heads=9, kv_heads=3)
    for cache_type in ("f32", "f16", "q8_0", "q4_0", "tq2", "tq3", "tq4"):
        storage, tables = filled_storage(cfg, cache_type, [300, 77])
        g = torch.Generator().manual_seed(3)
        q = torch.randn(300, cfg.num_heads, cfg.head_dim, generator=g)
        ours, reference = (prefill(storage, tables[0], 300, q, 0, None, use) for use in (True, False))
        if cache_type in ("q8_0", "q4_0") and prefill_int_keys():
            assert 1e-6 < (ours - reference).abs().max() < 2e-4  # integer keys: the int16 query's rounding
        else:
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-6)
        q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=g)
        ours, reference = (decode(storage, tables, [300, 77], q, 1, None, use) for use in (True, False))
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-6)


def _rotated_rows(isa: str, x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, D] through kv_write's rotation into an f32 cache (stored as rotated, uncoded)."""
    write = kernel("kv_write", "kv_write", isa)
    tokens, heads, dim = x.shape
    out = torch.full((heads * tokens, dim), float("nan"))
    slots = torch.arange(heads * tokens)
    write(0, x.data_ptr(), tokens, heads, dim, slots.data_ptr(), out.data_ptr(), dim * 4, None, 0,
          signs.data_ptr(), None, None, None)
    return out.view(heads, tokens, dim).transpose(0, 1)


@pytest.mark.parametrize("isa", FAST_PATHS)
@pytest.mark.parametrize("dim", [4, 16, 64, 128, 256])
def test_hadamard_rotation_same_bits_as_portable(isa, dim):
    """The rotated codecs' fast Walsh-Hadamard transform (native/hadamard.h): butterflies inside a vector
    by shuffles, across vectors by vector adds, in one order on every path, so the rotated keys are the
    same bits as the portable build's (and so are their codes); and it is the codec's matrix product."""
    from kvserve.kv.codecs import hadamard_signs, signed_hadamard

    x = torch.randn(7, 3, dim, generator=torch.Generator().manual_seed(dim)) * 5
    signs = torch.from_numpy(hadamard_signs(dim))
    ours = _rotated_rows(isa, x, signs)
    assert torch.equal(ours, _rotated_rows("portable", x, signs))
    exact = (x.double() @ signed_hadamard(signs).double()).float()
    torch.testing.assert_close(ours, exact, rtol=0, atol=2e-6 * x.abs().max().item() * dim ** 0.5)


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
