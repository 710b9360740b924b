"""Hugging Face folders (config.json + safetensors) mapped onto GGUF tensor names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError
from kvserve.lazy_torch import require, torch
from kvserve.models.arch import ARCHS, HF_CLASSES, sliding_layers, switches

ARCHITECTURES = HF_CLASSES  # config.json class -> arch

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
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # phi3: fused, as llama.cpp keeps it
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # phi3: gate then up, fused (GGUF's ffn_up too)
    "mlp.gate.weight": "ffn_gate_inp.weight",  # MoE router
}
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                 "down_proj": "ffn_down_exps.weight"}
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
        raise ModelLoadError(
            f"{folder}: architecture {archs or '?'} is not supported ({', '.join(ARCHITECTURES)})")
    spec = ARCHS[arch]
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    num_layers = cfg["num_hidden_layers"]
    # transformers 5 writes "rope_parameters" (theta and scaling together, per layer type for gemma3);
    # older files use "rope_theta" and "rope_scaling"
    rope_params = cfg.get("rope_parameters") or {}
    per_type = rope_params if "full_attention" in rope_params else {}
    rope = cfg.get("rope_scaling") or rope_params
    rope_theta = per_type.get("full_attention", {}).get("rope_theta") or cfg.get(
        "rope_theta", rope_params.get("rope_theta", spec.rope_theta))
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    window, types = _sliding(spec, cfg, num_layers)
    fields: dict[str, Any] = dict(
        switches(spec, cfg["hidden_size"]),
        num_layers=num_layers,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(rope, cfg),
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        sliding_window=window,
        sliding_window_layers=types,
        attention_bias=spec.attention_bias or bool(cfg.get("attention_bias")),
        tie_word_embeddings=cfg.get("tie_word_embeddings", arch != "llama"),
        name=folder.name,
    )
    if spec.moe:
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ModelLoadError(f"{folder}: dense layers between MoE layers are not supported")
        fields.update(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                      num_experts_per_tok=cfg["num_experts_per_tok"],
                      moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if arch == "granite":
        fields.update(embedding_scale=cfg.get("embedding_multiplier", 1.0),
                      residual_scale=cfg.get("residual_multiplier", 1.0),
                      attn_scale=cfg.get("attention_multiplier"),
                      logits_divisor=cfg.get("logits_scaling", 1.0))
    if arch in ("gemma2", "gemma3"):
        fields["attn_scale"] = cfg.get("query_pre_attn_scalar", head_dim) ** -0.5
    if arch == "gemma2":
        fields.update(attn_logit_softcap=cfg.get("attn_logit_softcapping"),
                      final_logit_softcap=cfg.get("final_logit_softcapping"))
    if arch == "gemma3":
        fields["rope_theta_local"] = per_type.get("sliding_attention", {}).get(
            "rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return ModelConfig(**fields)


def _sliding(spec, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """The window and which layers use it: config.json's layer_types where it has them (transformers 5),
    else the architecture's pattern (gemma3's older files: sliding_window_pattern)."""
    window = cfg.get("sliding_window")
    if spec.name == "gemma3":
        window = window or 512
    if not window or not spec.sliding or cfg.get("use_sliding_window") is False:
        return None, ()
    types = cfg.get("layer_types")
    if types:
        layers = tuple(t == "sliding_attention" for t in types)
    elif spec.name == "gemma3" and cfg.get("sliding_window_pattern", 6) != 6:
        pattern = cfg["sliding_window_pattern"]
        layers = tuple((i + 1) % pattern != 0 for i in range(num_layers))
    else:
        layers = sliding_layers(spec, num_layers, window)
    return (window, layers) if any(layers) else (None, ())


def _rope_scaling(rs: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        return RopeScaling("llama3", rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                           rs["original_max_position_embeddings"])
    if kind == "linear":
        return RopeScaling("linear", rs["factor"])
    original = rs.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if kind == "yarn":
        return RopeScaling("yarn", rs["factor"], original_max_position_embeddings=original or 4096,
                           attention_factor=rs.get("attention_factor"), beta_fast=rs.get("beta_fast") or 32.0,
                           beta_slow=rs.get("beta_slow") or 1.0)
    if kind in ("longrope", "su"):
        factor = rs.get("factor") or cfg.get("max_position_embeddings", original) / original
        return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                           attention_factor=rs.get("attention_factor"),
                           short_factor=tuple(rs["short_factor"]), long_factor=tuple(rs["long_factor"]))
    return RopeScaling()


def load_hf_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    require("torch")
    require("safetensors")
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files in the model folder")
    spec = ARCHS[config.architecture]
    layer_names = _GEMMA_LAYER_NAMES if spec.gemma_norms else _LAYER_NAMES
    weights: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # GGUF name -> expert -> [out, in]
    for f in files:
        for name, tensor in load_file(str(f)).items():
            mapped = _map_name(name, layer_names)
            if mapped is None:
                continue
            t = tensor.float()
            if isinstance(mapped, tuple):
                experts.setdefault(mapped[0], {})[mapped[1]] = t
                continue
            if spec.gemma_norms and mapped.endswith("norm.weight"):
                t = t + 1.0  # gemma norms scale by (1 + w); GGUF files store 1 + w already
            weights[mapped] = t
    for mapped, by_expert in experts.items():  # stacked as GGUF's *_exps tensors: [experts, out, in]
        if sorted(by_expert) != list(range(config.num_experts)):
            raise ModelLoadError(
                f"{folder}: {mapped} has experts {sorted(by_expert)}, not 0..{config.num_experts - 1}")
        weights[mapped] = torch.stack([by_expert[e] for e in range(config.num_experts)])
    if "output.weight" not in weights and not config.tie_word_embeddings:
        raise ModelLoadError(f"{folder}: lm_head.weight missing and embeddings are not tied")
    return weights


def _map_name(name: str, layer_names: dict[str, str]) -> str | tuple[str, int] | None:
    """The GGUF name of an HF tensor; (the stacked tensor's name, expert) for one expert's projection."""
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
    e = m and re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", m.group(2))
    if e and e.group(2) in _EXPERT_NAMES:
        return f"blk.{m.group(1)}.{_EXPERT_NAMES[e.group(2)]}", int(e.group(1))
    return None
