"""Broken or missing model inputs: each raises ModelLoadError (or a subclass) naming the problem.

Only the truncated-file case reads (the first megabyte of) the real SmolLM2 file; everything else is
written into tmp_path, so the module is fast and not marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve.errors import ModelLoadError, ModelNotFoundError
from kvserve.models.loader import load_model


def load_error(model: str) -> ModelLoadError:
    """The ModelLoadError that loading ``model`` raises (any other exception fails the test)."""
    with pytest.raises(ModelLoadError) as info:
        load_model(model, device="cpu")
    message = str(info.value)
    assert message.strip(), "the error must carry a message"
    assert "\n" not in message.strip(), f"the CLI prints errors as one line: {message!r}"
    return info.value


# A tiny well-formed llama GGUF: 1 layer, hidden 8, 2 heads, vocab 16.
_TINY_TENSORS = {
    "token_embd.weight": (16, 8),
    "output_norm.weight": (8,),
    "blk.0.attn_norm.weight": (8,),
    "blk.0.attn_q.weight": (8, 8),
    "blk.0.attn_k.weight": (8, 8),
    "blk.0.attn_v.weight": (8, 8),
    "blk.0.attn_output.weight": (8, 8),
    "blk.0.ffn_norm.weight": (8,),
    "blk.0.ffn_gate.weight": (16, 8),
    "blk.0.ffn_up.weight": (16, 8),
    "blk.0.ffn_down.weight": (8, 16),
}


def write_gguf(
    path: Path, arch: str = "llama", drop_tensors: tuple[str, ...] = (), head_count: bool = True
) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    if head_count:
        w.add_head_count(2)
        w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    for name, shape in _TINY_TENSORS.items():
        if name not in drop_tensors:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_control_loads(tmp_path):
    """The well-formed base of the broken files below does load (so the failures are about the defect)."""
    lm = load_model(str(write_gguf(tmp_path / "ok.gguf")), device="cpu")
    assert lm.config.architecture == "llama" and lm.config.num_layers == 1
    assert lm.tokenizer is None


# --- files that are not (whole) GGUF files ------------------------------------------------------------

def test_text_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model, just some text\n" * 10)
    err = load_error(str(path))
    assert str(path) in str(err)
    assert "not a GGUF file" in str(err)


def test_text_file_without_gguf_suffix(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    err = load_error(str(path))
    assert "not a GGUF file" in str(err)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    err = load_error(str(path))
    assert str(path) in str(err)
    assert "GGUF" in str(err)


def test_truncated_real_file(tmp_path):
    from kvserve.models.registry import resolve

    real = resolve("smollm2")  # make test pulls it
    path = tmp_path / "truncated.gguf"
    with open(real, "rb") as f:
        path.write_bytes(f.read(1 << 20))
    err = load_error(str(path))
    assert str(path) in str(err)
    assert "truncated" in str(err) or "malformed" in str(err)


def test_truncated_tiny_file_in_tensor_data(tmp_path):
    """Header and metadata intact, tensor data cut short."""
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: len(whole) - 200])
    err = load_error(str(path))
    assert "truncated" in str(err) or "malformed" in str(err)


# --- well-formed GGUF files we cannot run ---------------------------------------------------------------

def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", arch="mamba")
    err = load_error(str(path))
    assert "mamba" in str(err)
    assert "not supported" in str(err)


def test_missing_required_metadata(tmp_path):
    path = write_gguf(tmp_path / "noheads.gguf", head_count=False)
    err = load_error(str(path))
    assert "llama.attention.head_count" in str(err)


@pytest.mark.parametrize("tensor", ["blk.0.attn_q.weight", "token_embd.weight"])
def test_missing_tensor(tmp_path, tensor):
    """A GGUF that lacks a tensor the architecture needs: a ModelLoadError naming it, not a KeyError."""
    path = write_gguf(tmp_path / "missing.gguf", drop_tensors=(tensor,))
    err = load_error(str(path))
    assert tensor in str(err)


# --- names and paths that resolve to nothing -------------------------------------------------------------

def test_missing_path(tmp_path):
    path = tmp_path / "nowhere" / "model.gguf"
    err = load_error(str(path))
    assert isinstance(err, ModelNotFoundError)
    assert str(path) in str(err)
    assert "no such file" in str(err)


def test_unknown_registry_name():
    err = load_error("no-such-model-xyz")
    assert isinstance(err, ModelNotFoundError)
    assert "no-such-model-xyz" in str(err)
    assert "unknown model" in str(err)
    assert "smollm2" in str(err), "the message lists the known names"


# --- Hugging Face folders --------------------------------------------------------------------------------

def test_folder_without_config_json(tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    err = load_error(str(folder))
    assert str(folder) in str(err)
    assert "config.json" in str(err)


_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_attention_heads": 2,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "vocab_size": 16,
}


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_LLAMA_CONFIG))
    err = load_error(str(tmp_path))
    assert "safetensors" in str(err)


def test_folder_with_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    err = load_error(str(tmp_path))
    assert "config.json" in str(err)


def test_folder_with_unsupported_architecture(tmp_path):
    cfg = {**_LLAMA_CONFIG, "architectures": ["MambaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    err = load_error(str(tmp_path))
    assert "MambaForCausalLM" in str(err)
    assert "not supported" in str(err)


def test_folder_config_missing_required_key(tmp_path):
    """config.json without num_attention_heads: a ModelLoadError naming the key, not a KeyError."""
    cfg = dict(_LLAMA_CONFIG)
    del cfg["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    err = load_error(str(tmp_path))
    assert "num_attention_heads" in str(err)


def test_unknown_weight_format_is_a_clear_error():
    from kvserve.models.linear import make_linear

    with pytest.raises(ValueError, match="unknown weight format 'int4'"):
        make_linear(torch.zeros(2, 2), None, "int4", torch.device("cpu"), torch.float32)
