"""Prebuilt kernel libraries: the wheel's per-path libraries load on a machine with no compiler, the
fastest path the CPU runs first, and only while they match the sources beside them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from kvserve import native

ROOT = Path(__file__).resolve().parents[2]
BEST = native.runnable_isas()[0]


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVSERVE_ISA", raising=False)
    native.load.cache_clear()
    yield
    native.load.cache_clear()


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    if native.compiler() is None:
        pytest.skip("not run: prebuilding needs a C compiler")
    destination = tmp_path_factory.mktemp("prebuilt")
    paths = list(dict.fromkeys([BEST, "portable"]))
    manifest = native.prebuild(destination, isas=paths, kernels=["rms_norm"])
    assert sorted(manifest) == sorted(f"{p}/rms_norm" for p in paths)
    return destination


def rms_norm(library) -> np.ndarray:
    fn = native.abi.bind(library, "rms_norm")
    x = np.linspace(-2, 3, 4 * 64, dtype=np.float32).reshape(4, 64)
    w = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    out = np.empty_like(x)
    fn(x.ctypes.data, w.ctypes.data, 1e-6, 4, 64, out.ctypes.data)
    return out


def test_no_compiler_loads_the_fastest_prebuilt_path(monkeypatch, prebuilt, no_compiler):
    monkeypatch.setattr(native, "PREBUILT_DIR", prebuilt)
    library = native.load("rms_norm")
    assert library is not None
    choice = native.choices()["rms_norm"]
    assert (choice.how, choice.isa, Path(choice.path).parent.name) == ("prebuilt", BEST, BEST)
    x = np.linspace(-2, 3, 4 * 64, dtype=np.float32).reshape(4, 64)
    w = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rms_norm(library), expected, rtol=2e-6, atol=1e-6)
    assert native.load("rms_norm", "portable") is not None
    assert native.choices()["rms_norm"].isa == "portable"


def test_a_prebuilt_library_of_other_sources_is_not_loaded(monkeypatch, prebuilt, no_compiler, caplog):
    monkeypatch.setattr(native, "PREBUILT_DIR", prebuilt)
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-DKVSERVE_EDITED"])  # as if the source changed
    with caplog.at_level(logging.INFO, logger="kvserve.native"):
        assert native.load("rms_norm") is None
    assert "built from other sources or flags" in caplog.text
    assert "no C compiler found and no prebuilt rms_norm library fits" in caplog.text


def test_a_damaged_manifest_means_no_prebuilt_library(monkeypatch, prebuilt, no_compiler, tmp_path):
    copy = tmp_path / "prebuilt"
    (copy / BEST).mkdir(parents=True)
    (copy / BEST / "rms_norm.so").write_bytes((prebuilt / BEST / "rms_norm.so").read_bytes())
    (copy / native.MANIFEST).write_text("{not json")
    monkeypatch.setattr(native, "PREBUILT_DIR", copy)
    assert native.load("rms_norm") is None


def test_a_path_the_compiler_cannot_build_is_left_out(monkeypatch, tmp_path):
    if native.compiler() is None:
        pytest.skip("not run: prebuilding needs a C compiler")
    monkeypatch.setitem(native.ISA_FLAGS, "avxvnni", ["-mno-such-flag"])
    manifest = native.prebuild(tmp_path, isas=["avxvnni", "portable"], kernels=["rms_norm"])
    assert list(manifest) == ["portable/rms_norm"]
    assert not (tmp_path / "avxvnni").exists()
    assert json.loads((tmp_path / native.MANIFEST).read_text()) == manifest
    with pytest.raises(ValueError, match="no instruction-set path"):
        native.prebuild(tmp_path, isas=["sse9"])


def test_the_wheel_carries_the_kernels_and_a_platform_tag(tmp_path):
    """`pip wheel .` (one path here, to keep it short): a py3-none-<platform> wheel whose libraries
    and manifest sit in the package."""
    if native.compiler() is None:
        pytest.skip("not run: building the wheel's kernels needs a C compiler")
    env = {**__import__("os").environ, "KVSERVE_PREBUILD_ISAS": "portable"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path)], check=False, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvserve-*.whl")
    assert wheel.name.endswith(f"-py3-none-linux_{native.platform.machine()}.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("kvserve/native/prebuilt/manifest.json"))
    sources = sorted(p.stem for p in native.SOURCE_DIR.glob("*.c"))
    assert sorted(manifest) == [f"portable/{s}" for s in sources]
    assert {f"kvserve/native/prebuilt/portable/{s}.so" for s in sources} <= names
    keys = {s: native.source_key(s, native.build_flags(s, "portable")) for s in sources}
    assert manifest == {f"portable/{s}": keys[s] for s in sources}
