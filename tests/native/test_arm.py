"""The integer kernels built for aarch64 (Debian's gcc-aarch64-linux-gnu) and run under qemu-aarch64:
NEON with and without sdot, and the portable C, each the same bits as this machine's portable build
on the same inputs; the attention kernels (soft-capped or not) on each path within float rounding of a
float64 reference. Reported as skipped, with the reason, where the cross tools are missing
(``make test`` installs them)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import native
from kvserve.attention import native_paged
from kvserve.kv.codecs import make_codec
from kvserve.models.weight_grids import int8_groups, pack_int8_groups
from tests.native.isa_cases import (
    LAYOUTS,
    grid16_inputs,
    layout_code,
    layout_inputs,
    layout_shapes,
    run_int4,
    run_int8,
)

CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
DRIVER = Path(__file__).with_name("arm_driver.c")
ATTENTION_DRIVER = Path(__file__).with_name("arm_attention_driver.c")
ARM_PATHS = {"neon-dotprod": native.ISA_FLAGS["neon"], "neon": ["-march=armv8-a"],
             "portable": ["-DKVSERVE_PORTABLE"]}

pytestmark = pytest.mark.skipif(
    not (shutil.which(CROSS_CC) and shutil.which(QEMU)),
    reason=f"not run: {CROSS_CC} and {QEMU} are not installed (Debian: gcc-aarch64-linux-gnu qemu-user)",
)


@pytest.fixture(scope="module")
def arm_programs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("arm")
    programs = {}
    for path, flags in ARM_PATHS.items():
        program = out / f"kernels-{path}"
        kernels = ("int4_matmul", "int8_matmul", "kv_write")
        sources = [*(native.SOURCE_DIR / f"{name}.c" for name in kernels), DRIVER]
        base = [f for f in native.FLAGS if f not in ("-fPIC", "-shared")]
        subprocess.run([CROSS_CC, *base, *native.SOURCE_FLAGS["int4_matmul"], *flags,
                        f"-I{native.SOURCE_DIR}", "-static", *map(str, sources), "-o", str(program)],
                       check=True, capture_output=True, text=True, timeout=300)
        programs[path] = program
    return programs


def run_arm(program: Path, tmp_path: Path, kind: int, x, packed, bias, n: int, digits: int = 0,
            layout: int = 0) -> tuple:
    m, k = x.shape
    header = np.array([kind, m, n, k, digits, layout, packed.numel(), bias is not None], dtype=np.int32)
    parts = [header.tobytes(), x.numpy().tobytes(), packed.numpy().tobytes()]
    if bias is not None:
        parts.append(bias.numpy().tobytes())
    (tmp_path / "in").write_bytes(b"".join(parts))
    subprocess.run([QEMU, str(program), str(tmp_path / "in"), str(tmp_path / "out")], check=True, timeout=300)
    raw = (tmp_path / "out").read_bytes()
    y = torch.from_numpy(np.frombuffer(raw[: 4 * m * n], dtype=np.float32).copy()).view(m, n)
    return y, raw[4 * m * n :].decode()


@pytest.mark.parametrize("path", list(ARM_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_arm_int4_matmul_same_bits_as_x86_portable(arm_programs, tmp_path, path, layout):
    for digits in (2, 1):
        for seed, (m, n, k) in enumerate(layout_shapes(layout)[:2]):
            x, packed, bias = layout_inputs(m, n, k, seed, layout)
            y, isa = run_arm(arm_programs[path], tmp_path, 4, x, packed, bias, n, digits, layout_code(layout))
            assert isa == path
            reference = run_int4("portable", x, packed, bias, n, digits, 1, layout)
            assert torch.equal(y, reference), (path, digits, layout, m, n, k)


@pytest.mark.parametrize("path", list(ARM_PATHS))
def test_arm_int8_groups16_same_bits_as_x86_portable(arm_programs, tmp_path, path):
    for seed, (m, n, k) in enumerate([(1, 40, 64), (9, 56, 192)]):
        x, packed = grid16_inputs(m, n, k, seed)
        y, isa = run_arm(arm_programs[path], tmp_path, 16, x, packed, None, n)
        assert isa == path
        assert torch.equal(y, run_int8("portable", x, packed, n, 1, "int8_matmul_g16")), (path, m, n, k)


@pytest.mark.parametrize("path", list(ARM_PATHS))
def test_arm_hadamard_rotation_same_bits_as_x86_portable(arm_programs, tmp_path, path):
    """The rotated codecs' fast Walsh-Hadamard transform (native/hadamard.h): NEON's in-register
    butterflies give the x86 portable build's bits."""
    from kvserve.kv.codecs import hadamard_signs
    from tests.native.test_isa_paths import _rotated_rows

    for dim in (2, 16, 64, 256):
        x = torch.randn(5, 3, dim, generator=torch.Generator().manual_seed(dim)) * 5
        signs = torch.from_numpy(hadamard_signs(dim))
        header = np.array([32, 5, 3, 3 * dim, 0, 0, 4 * dim, 0], dtype=np.int32)
        (tmp_path / "in").write_bytes(header.tobytes() + x.numpy().tobytes() + signs.numpy().tobytes())
        subprocess.run([QEMU, str(arm_programs[path]), str(tmp_path / "in"), str(tmp_path / "out")],
                       check=True, timeout=300)
        raw = (tmp_path / "out").read_bytes()
        assert raw[4 * x.numel():].decode() == path
        ours = torch.from_numpy(np.frombuffer(raw[: 4 * x.numel()], dtype=np.float32).copy())
        reference = _rotated_rows("portable", x, signs)
        assert torch.equal(ours.view(3, 5, dim).transpose(0, 1), reference), (path, dim)


@pytest.mark.parametrize("path", list(ARM_PATHS))
def test_arm_int8_head_same_bits_as_x86_portable(arm_programs, tmp_path, path):
    for seed, (m, n, k) in enumerate([(1, 40, 64), (9, 56, 190)]):
        g = torch.Generator().manual_seed(seed)
        packed = pack_int8_groups(*int8_groups(torch.randn(n, k, generator=g)))
        x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)
        y, isa = run_arm(arm_programs[path], tmp_path, 8, x, packed, None, n)
        assert isa == path
        assert torch.equal(y, run_int8("portable", x, packed, n, 1)), (path, m, n, k)


@pytest.fixture(scope="module")
def arm_attention_programs(tmp_path_factory) -> dict[str, Path]:
    """paged_attention.c with its own flags, for each aarch64 path."""
    out = tmp_path_factory.mktemp("arm-attention")
    base = [f for f in native.FLAGS if f not in ("-fPIC", "-shared")]
    programs = {}
    for path, flags in ARM_PATHS.items():
        programs[path] = out / f"attention-{path}"
        sources = [native.SOURCE_DIR / "paged_attention.c", ATTENTION_DRIVER]
        subprocess.run([CROSS_CC, *base, *flags, f"-I{native.SOURCE_DIR}", "-static", *map(str, sources),
                        "-o", str(programs[path])], check=True, capture_output=True, text=True, timeout=300)
    return programs


def run_arm_attention(program: Path, tmp_path: Path, prefill: bool, q, k, v, table, window: int, ctx: int,
                      scale: float, softcap: float, codec=None) -> tuple[torch.Tensor, str]:
    """k, v: f32 [kv_heads, blocks, block_size, d], stored as ``codec`` encodes them (None: f32)."""
    kv_heads, blocks, block_size, d = k.shape
    n, heads, _ = q.shape
    stored = [codec.encode(x) if codec else [x] for x in (k, v)]
    codes, *scales = stored[0]
    code_bytes = codes.shape[-1] * codes.element_size()
    scale_bytes = scales[0].shape[-1] * scales[0].element_size() if scales else 0
    kind = native_paged.KV_KIND_CODES[codec.name if codec else "f32"]
    header = np.array([prefill, n, heads, kv_heads, d, blocks, block_size, window, ctx, kind, code_bytes,
                       scale_bytes],
                      dtype=np.int32)
    parts = [header.tobytes(), np.array([scale, softcap], dtype=np.float32).tobytes(),
             q.contiguous().numpy().tobytes()]
    for codes, *scales in stored:
        parts += [codes.contiguous().view(torch.uint8).numpy().tobytes(),
                  b"".join(s.contiguous().view(torch.uint8).numpy().tobytes() for s in scales)]
    # the driver reads num_blocks entries
    parts.append(np.resize(table.numpy().astype(np.int64), blocks).tobytes())
    (tmp_path / "in").write_bytes(b"".join(parts))
    subprocess.run([QEMU, str(program), str(tmp_path / "in"), str(tmp_path / "out")], check=True, timeout=300)
    raw = (tmp_path / "out").read_bytes()
    out = torch.from_numpy(np.frombuffer(raw[: 4 * q.numel()], dtype=np.float32).copy()).view(q.shape)
    return out, raw[4 * q.numel() :].decode()


@pytest.mark.parametrize("path", list(ARM_PATHS))
def test_arm_attention_capped_and_not_matches_float64(arm_attention_programs, tmp_path, path):
    """Decode (one query at the last position) and a prefill chunk of 90 queries over 300 positions in
    shuffled blocks of 16, with and without a window and a cap."""
    from tests.native.softcap_reference import capped_reference

    g = torch.Generator().manual_seed(9)
    heads, kv_heads, d, blocks, block_size, ctx = 6, 2, 64, 24, 16, 300
    k, v = (torch.randn(kv_heads, blocks, block_size, d, generator=g) for _ in range(2))
    table = torch.randperm(blocks, generator=g)[: -(-ctx // block_size)]
    keys, values = (x[:, table].reshape(kv_heads, -1, d)[:, :ctx].double() for x in (k, v))
    q = 4 * torch.randn(90, heads, d, generator=g)
    for window, softcap in ((0, 0.0), (0, 5.0), (37, 5.0)):
        cap = softcap or 1e9  # no cap: tanh(s / 1e9) * 1e9 is s to float64's rounding
        for prefill, chunk in ((False, q[-1:]), (True, q)):
            out, isa = run_arm_attention(arm_attention_programs[path], tmp_path, prefill, chunk, k, v, table,
                                         window, ctx, 0.125, softcap)
            assert isa == path
            positions = torch.arange(ctx - chunk.shape[0], ctx)
            reference = capped_reference(chunk, keys, values, positions, window or None, 0.125, cap)
            # scores up to ~16 (|q| ~ 4), each rounded in f32: outputs a few 1e-6 off here and there
            torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", list(ARM_PATHS))
@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0", "q4_0"])
def test_arm_attention_reads_each_kv_type_in_place(arm_attention_programs, tmp_path, path, cache_type):
    """Decode and a prefill chunk over blocks of each type (decode reads them in registers, a block's
    partial rows through the buffer), against float64 over the values the codec decodes."""
    from tests.native.softcap_reference import capped_reference

    g = torch.Generator().manual_seed(10)
    heads, kv_heads, d, blocks, block_size, ctx = 6, 2, 64, 24, 16, 300
    codec = make_codec(cache_type, d)
    k, v = (torch.randn(kv_heads, blocks, block_size, d, generator=g) for _ in range(2))
    table = torch.randperm(blocks, generator=g)[: -(-ctx // block_size)]
    keys, values = (
        codec.decode(codec.encode(x), torch.float32)[:, table].reshape(kv_heads, -1, d)[:, :ctx].double()
                    for x in (k, v))
    q = 4 * torch.randn(20, heads, d, generator=g)
    for window in (0, 37):
        for prefill, chunk in ((False, q[-1:]), (True, q)):
            out, isa = run_arm_attention(arm_attention_programs[path], tmp_path, prefill, chunk, k, v, table,
                                         window, ctx, 0.125, 0.0, codec)
            assert isa == path
            positions = torch.arange(ctx - chunk.shape[0], ctx)
            reference = capped_reference(chunk, keys, values, positions, window or None, 0.125, 1e9)
            torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
