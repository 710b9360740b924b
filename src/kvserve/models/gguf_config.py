"""``ModelConfig`` from GGUF metadata. Torch-free: the planner reads configs without loading torch."""

from __future__ import annotations

from typing import Any

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")


def read_model_config(h, require_supported: bool = True) -> ModelConfig:
    """``h`` is a ``GGUFHeader`` (anything with get / require / architecture / tensors). With
    ``require_supported`` off, any architecture with Llama-style keys is read (the planner plans
    models the engine cannot run yet)."""
    arch = h.architecture
    if require_supported and arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{h.path}: architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

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
    # Llama 3.x files carry their frequency scaling as rope_freqs.weight (read with the weights)
    scaling = RopeScaling()
    if key("rope.scaling.type") == "linear" and key("rope.scaling.factor"):
        scaling = RopeScaling(rope_type="linear", factor=float(key("rope.scaling.factor")))
    fields: dict[str, Any] = dict(
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(h.require(f"{arch}.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in h.tensors,
        name=str(h.get("general.name", "") or ""),
    )
    if arch == "qwen2":
        fields["attention_bias"] = True
        fields["rope_theta"] = float(key("rope.freq_base", 1000000.0))
    if arch == "gemma3":
        pattern = 6  # five local layers, then one global
        fields.update(
            qk_norm=True,
            post_norms=True,
            hidden_act="gelu_tanh",
            embedding_scale=float(hidden) ** 0.5,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            sliding_window=int(key("attention.sliding_window", 512)),
            sliding_window_layers=tuple((i + 1) % pattern != 0 for i in range(num_layers)),
            rope_theta=float(key("rope.freq_base", 1000000.0)),
            rope_theta_local=10000.0,
            attn_scale=float(head_dim) ** -0.5,
        )
    return ModelConfig(**fields)
