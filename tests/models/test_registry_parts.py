"""Registry models shipped as part packages (qwen2.5-coder-0.5b: six packages, each a data/partNN.bin)
are joined in order into one file under the models directory, checked against the stated size, written
beside the target and renamed (never a half file); a missing part means not installed."""

from __future__ import annotations

import pytest

from kvserve.errors import ModelLoadError
from kvserve.models import registry


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three fake part packages holding b"aaaa", b"bb", b"c"; the models directory in tmp_path."""
    dirs = {}
    for i, data in enumerate([b"aaaa", b"bb", b"c"], 1):
        folder = tmp_path / f"pkg{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)
        dirs[f"fake_part{i}"] = folder
    monkeypatch.setattr(registry, "_package_dir", lambda module: dirs.get(module))
    monkeypatch.setenv("KVSERVE_MODELS", str(tmp_path / "models"))
    entry = registry.RegistryEntry("fake", "a fake", ("fake-part1",), "fake_part1", "fake.gguf",
                                   parts=("fake_part1", "fake_part2", "fake_part3"), size=7)
    return entry, dirs


def test_parts_are_joined_in_order(parts):
    entry, _ = parts
    path = registry.installed_path(entry)
    assert path.read_bytes() == b"aaaabbc" and path.parent == registry.models_dir()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no partial file left
    assert registry.installed_path(entry) == path  # found, not joined again


def test_a_missing_part_is_not_installed(parts):
    entry, dirs = parts
    del dirs["fake_part2"]
    assert registry.installed_path(entry) is None


def test_parts_of_the_wrong_size_are_refused(parts):
    entry, dirs = parts
    (dirs["fake_part3"] / "data" / "part03.bin").write_bytes(b"cc")
    with pytest.raises(ModelLoadError, match="hold 8 bytes, not 7"):
        registry.installed_path(entry)
    assert not registry.models_dir().exists() or not list(registry.models_dir().iterdir())


def test_planning_reads_the_parts_without_joining(parts):
    entry, _ = parts
    assert registry.installed_path(entry, assemble=False).name.startswith("pkg1")
    assert [p.read_bytes() for p in registry.part_paths(entry)] == [b"aaaa", b"bb", b"c"]
