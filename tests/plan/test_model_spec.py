"""MODEL arguments: GGUF files, registry names (without assembling chunked models), HF folders, presets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.errors import ModelLoadError, ModelNotFoundError
from kvserve.plan.model_spec import resolve_model
from kvserve.plan.presets import num_params

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "max_position_embeddings": 256,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}


def test_registry_name_reads_the_installed_gguf_header(smollm2_path):
    spec = resolve_model("smollm2")
    assert str(smollm2_path) in spec.source
    assert (spec.num_params, spec.stored_bytes) == (134_515_008, 66355200 + 30081024 + 140544)
    assert resolve_model(str(smollm2_path)) == spec


def test_unassembled_registry_model_is_planned_from_its_chunks(tmp_path, monkeypatch):
    import importlib

    from kvserve.models.registry import REGISTRY, installed_path

    entry = REGISTRY["gemma3-270m"]
    assert installed_path(entry,
                          assemble=False) is not None, "gemma3-270m is not installed (make test pulls it)"
    module = importlib.import_module(entry.module)
    monkeypatch.setattr(module, "default_output_path", lambda base_dir=None: tmp_path / "not-assembled.gguf")
    monkeypatch.setattr(
        module, "assemble", lambda *a, **k: pytest.fail("planning must not assemble the model")
    )
    spec = resolve_model("gemma3-270m")
    assert "not assembled" in spec.source
    assert spec.config.sliding_window == 512 and spec.num_params == 268_098_176
    assert not (tmp_path / "not-assembled.gguf").exists()


def test_hf_folder_weights_come_from_safetensors_headers(tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    save_file(
        {
            "model.embed_tokens.weight": np.zeros((100, 64), np.float16),
            "model.norm.weight": np.zeros(64, np.float32),
        },
        str(tmp_path / "model.safetensors"),
    )
    spec = resolve_model(str(tmp_path))
    assert spec.config.num_kv_heads == 2 and spec.config.head_dim == 16
    assert spec.num_params == 100 * 64 + 64
    assert spec.stored_by_type == {"F16": 100 * 64 * 2, "F32": 64 * 4}
    assert resolve_model(str(tmp_path / "config.json")).stored_bytes == spec.stored_bytes


def test_hf_config_without_weights_uses_the_parameter_count(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    spec = resolve_model(str(tmp_path / "config.json"))
    assert (
        spec.num_params
        == num_params(spec.config)
        == 100 * 64 * 2 + 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    )
    assert spec.stored_bytes == 2 * spec.num_params  # float16 per config.json


def test_preset():
    spec = resolve_model("llama-3.1-70b")
    assert spec.name == "Llama-3.1-70B" and spec.stored_bytes == 2 * 70_553_706_496
    assert spec.stored_by_type == {"BF16": spec.stored_bytes}


def test_unknown_and_missing_models(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'Llama-9'.*Llama-3.1-8B"):
        resolve_model("Llama-9")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="needs a config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.safetensors").write_bytes(b"\xff" * 16)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_held_bytes_are_what_the_loaded_model_holds(name):
    """The plan's weights in the engine's default format (q4) against the loaded model's own: every
    projection's packed bytes, the head, the norms (and an f32 embedding, or the file's bytes of one,
    where one is kept), within 1%."""

    from kvserve.models.loader import load_model
    from kvserve.plan.model_spec import held_bytes

    spec = resolve_model(name)
    model = load_model(name, weight_format="q4").model
    linears = [model.lm_head] + [lin for layer in model.layers for lin in layer.linears]
    norms = [model.final_norm] + [t for layer in model.layers for t in (
        layer.attn_norm, layer.ffn_norm, layer.q_norm, layer.k_norm, layer.post_attn_norm,
        layer.post_ffn_norm)
        if t is not None]
    held = sum(lin.nbytes for lin in linears) + sum(4 * np.asarray(t).size for t in norms)
    held += 0 if model.embed is None else model.embed.numel() * model.embed.element_size()
    held += 0 if model.embed_rows is None else model.embed_rows.nbytes
    assert abs(held_bytes(spec.tensors, "q4") - held) <= 0.01 * held
