"""``ModelConfig`` from GGUF metadata. Torch-free: the planner reads configs without loading torch."""

from __future__ import annotations

from typing import Any

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError
from kvserve.models.arch import ARCHS, SUPPORTED_ARCHITECTURES, sliding_layers, switches


def read_model_config(h, require_supported: bool = True) -> ModelConfig:
    """``h`` is a ``GGUFHeader`` (anything with get / require / architecture / tensors). With
    ``require_supported`` off, any architecture with Llama-style keys is read (the planner plans
    models the engine cannot run yet)."""
    arch = h.architecture
    if require_supported and arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{h.path}: architecture '{arch}' is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    spec = ARCHS.get(arch, ARCHS["llama"])

    def key(name: str, default: Any = None) -> Any:
        return h.get(f"{arch}.{name}", default)

    num_heads = int(h.require(f"{arch}.attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer lists exist in some files; the cache needs the largest
        num_kv_heads = max(num_kv_heads)
    hidden = int(h.require(f"{arch}.embedding_length"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    vocab = key("vocab_size") or len(h.get("tokenizer.ggml.tokens", []) or [])
    if not vocab and "token_embd.weight" in h.tensors:
        vocab = int(h.tensors["token_embd.weight"].dims[1])
    num_layers = int(h.require(f"{arch}.block_count"))
    window = key("attention.sliding_window")
    rotary_dim = key("rope.dimension_count")
    fields: dict[str, Any] = dict(
        switches(spec, hidden),
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length",
                                  0) if spec.moe else h.require(f"{arch}.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", spec.rms_norm_eps)),
        rope_theta=float(key("rope.freq_base", spec.rope_theta)),
        rope_scaling=_rope_scaling(key),
        rotary_dim=int(rotary_dim) if rotary_dim and int(rotary_dim) < head_dim else None,
        sliding_window=int(window) if window and spec.sliding else None,
        sliding_window_layers=sliding_layers(spec, num_layers, window),
        tie_word_embeddings="output.weight" not in h.tensors,
        name=str(h.get("general.name", "") or ""),
    )
    if spec.moe:
        fields.update(_moe_fields(h, arch, key, fields["intermediate_size"]))
    _arch_fields(fields, arch, spec, key, window)
    return ModelConfig(**fields)


def _moe_fields(h, arch: str, key, intermediate_size: int) -> dict[str, Any]:
    """A mixture of experts' fields: how many experts, how many each token uses, their width."""
    return {"num_experts": int(h.require(f"{arch}.expert_count")),
            "num_experts_per_tok": int(h.require(f"{arch}.expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length", 0) or intermediate_size),
            # llama.cpp renormalizes qwen3moe's chosen weights always, olmoe's never
            "norm_topk_prob": bool(key("expert_weights_norm", arch == "qwen3moe"))}


def _arch_fields(fields: dict[str, Any], arch: str, spec, key, window) -> None:
    """``fields`` updated with what one architecture adds or fixes (granite's multipliers, the attention
    scale, Gemma's soft caps and windows); ``window`` is the file's sliding window, if any."""
    if arch == "granite":  # llama.cpp spells its multipliers so; logit_scale divides
        fields.update(embedding_scale=float(key("embedding_scale", 1.0)),
                      residual_scale=float(key("residual_scale", 1.0)),
                      logits_divisor=float(key("logit_scale", 1.0)))
    if key("attention.scale") is not None:
        fields["attn_scale"] = float(key("attention.scale"))
    num_layers, head_dim = fields["num_layers"], fields["head_dim"]
    if arch == "gemma2":
        # query_pre_attn_scalar is not in the file: head_dim, but hidden / heads for the 27B (as llama.cpp)
        per_head = fields["hidden_size"] / fields["num_heads"] if num_layers == 46 else head_dim
        fields.setdefault("attn_scale", per_head ** -0.5)
        fields.update(attn_logit_softcap=key("attn_logit_softcapping"),
                      final_logit_softcap=key("final_logit_softcapping"))
    if arch == "gemma3":
        fields.update(rope_theta_local=10000.0, attn_scale=float(head_dim) ** -0.5)
        if not window:
            fields.update(sliding_window=512, sliding_window_layers=sliding_layers(spec, num_layers, 512))


def _rope_scaling(key) -> RopeScaling:
    """The scaling GGUF files state in keys (Llama 3's comes as rope_freqs.weight, Phi-3's LongRoPE as
    rope_factors_*.weight: read with the weights)."""
    kind, factor = key("rope.scaling.type"), key("rope.scaling.factor")
    if kind == "linear" and factor:
        return RopeScaling(rope_type="linear", factor=float(factor))
    original = int(key("rope.scaling.original_context_length", 4096))
    if kind == "yarn" and factor:
        return RopeScaling(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original,
                           beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
                           beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0) or 1.0))
    attn_factor = key("rope.scaling.attn_factor")
    if attn_factor is not None:  # phi3: LongRoPE's cos/sin scale, the factors in tensors
        return RopeScaling(rope_type="longrope", attention_factor=float(attn_factor),
                           original_max_position_embeddings=original)
    return RopeScaling()
