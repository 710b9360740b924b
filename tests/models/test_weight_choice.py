"""--weights auto (models/weight_choice.py): exact activations where the CPU has a fused integer dot
product, llama.cpp's int8 activations where it has none and the file's q4-fast KLD was measured at most
llama.cpp's, exact otherwise; f32 off the CPU and for HF folders; each choice with its reason."""

from __future__ import annotations

import pytest

from kvserve.models import registry, weight_choice
from kvserve.models.registry import resolve


@pytest.fixture
def smollm2_measured(monkeypatch):
    entry = registry.REGISTRY["smollm2"]
    monkeypatch.setitem(registry.REGISTRY, "smollm2", registry.RegistryEntry(**{
        **{f: getattr(entry, f) for f in entry.__slots__}, "fast_kld_ok": True}))
    return resolve("smollm2")


@pytest.mark.parametrize("isa", ["avx512vnni", "avxvnni", "neon-dotprod"])
def test_a_fused_dot_product_keeps_exact_activations(smollm2_measured, isa):
    choice = weight_choice.choose(smollm2_measured, "cpu", isa)
    assert choice.format == "q4" and isa in choice.why


@pytest.mark.parametrize("isa", ["avx2", "neon", "portable"])
def test_without_one_a_measured_file_takes_llama_cpps_activations(smollm2_measured, isa):
    choice = weight_choice.choose(smollm2_measured, "cpu", isa)
    assert choice.format == "q4-fast" and "smollm2" in choice.why and "llama.cpp" in choice.why


def test_without_one_an_unmeasured_file_stays_exact(monkeypatch):
    path = resolve("smollm2")
    entry = registry.REGISTRY["smollm2"]
    monkeypatch.setitem(registry.REGISTRY, "smollm2", registry.RegistryEntry(**{
        **{f: getattr(entry, f) for f in entry.__slots__}, "fast_kld_ok": False}))
    choice = weight_choice.choose(path, "cpu", "avx2")
    assert choice.format == "q4" and "no measurement" in choice.why


def test_off_the_cpu_or_for_a_folder_f32(tmp_path):
    assert weight_choice.choose(resolve("smollm2"), "cuda", "avx2").format == "f32"
    assert weight_choice.choose(tmp_path, "cpu", "avx2").format == "f32"


def test_the_loaded_model_says_why(monkeypatch):
    from kvserve.models.loader import load_model

    loaded = load_model("smollm2", weight_format="auto")
    assert loaded.model.weight_format in ("q4", "q4-fast") and loaded.weights_why
    assert load_model("smollm2", weight_format="q4").weights_why == ""


def test_the_measured_file_is_recognized_through_a_link(smollm2_measured, tmp_path):
    link = tmp_path / "model.gguf"
    link.symlink_to(smollm2_measured)
    assert weight_choice.choose(link, "cpu", "avx2").format == "q4-fast"
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(b"GGUF")  # another file, whatever its name: not measured
    assert weight_choice.choose(copy, "cpu", "avx2").format == "q4"
