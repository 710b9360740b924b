"""Hugging Face folders (config.json + safetensors) mapped onto GGUF tensor names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def read_hf_config(folder: Path) -> ModelConfig:
    try:
        cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{folder}: cannot read config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{folder}: config.json must hold a JSON object")
    cfg = cfg.get("text_config", cfg)
    try:
        return _config_from_dict(folder, cfg)
    except KeyError as e:
        raise ModelLoadError(f"{folder}: config.json lacks {e}") from None


def _config_from_dict(folder: Path, cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{folder}: architecture {archs or '?'} is not supported ({', '.join(ARCHITECTURES)})")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    # transformers 5 writes "rope_parameters" (theta and scaling together); older files use
    # "rope_theta" and "rope_scaling"
    rope_params = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or rope_params
    scaling = RopeScaling()
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        scaling = RopeScaling("llama3", rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                              rs["original_max_position_embeddings"])
    elif kind == "linear":
        scaling = RopeScaling("linear", rs["factor"])
    fields: dict[str, Any] = dict(
        architecture=arch,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias")),
        tie_word_embeddings=cfg.get("tie_word_embeddings", arch != "llama"),
        name=folder.name,
    )
    if arch == "gemma3":
        window = cfg.get("sliding_window", 512)
        pattern = cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(fields["num_layers"])
        ]
        per_type = rope_params if "full_attention" in rope_params else {}  # transformers 5: per layer type
        fields.update(qk_norm=True, post_norms=True, hidden_act="gelu_tanh",
                      embedding_scale=cfg["hidden_size"] ** 0.5, sliding_window=window,
                      sliding_window_layers=tuple(t == "sliding_attention" for t in types),
                      rope_theta=per_type.get("full_attention", {}).get("rope_theta", fields["rope_theta"]),
                      rope_theta_local=per_type.get("sliding_attention", {}).get(
                          "rope_theta", cfg.get("rope_local_base_freq", 10000.0)),
                      attn_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5)
    return ModelConfig(**fields)


def load_hf_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files in the model folder")
    layer_names = _GEMMA_LAYER_NAMES if config.architecture == "gemma3" else _LAYER_NAMES
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            mapped = _map_name(name, layer_names)
            if mapped is None:
                continue
            t = tensor.float()
            if config.architecture == "gemma3" and mapped.endswith("norm.weight"):
                t = t + 1.0  # gemma norms scale by (1 + w); GGUF files store 1 + w already
            weights[mapped] = t
    if "output.weight" not in weights and not config.tie_word_embeddings:
        raise ModelLoadError(f"{folder}: lm_head.weight missing and embeddings are not tied")
    return weights


def _map_name(name: str, layer_names: dict[str, str]) -> str | None:
    name = name.removeprefix("language_model.").removeprefix("model.language_model.")
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in layer_names:
        return f"blk.{m.group(1)}.{layer_names[m.group(2)]}"
    return None
