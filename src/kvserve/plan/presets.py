"""Models people ask about, described by their published Hugging Face ``config.json`` values.

A preset is a ``ModelConfig`` (the text model only: Gemma 3's 4B/12B/27B vision towers are left out)
plus its parameter count from the Llama-family formula; its weights are planned at bf16, the type
the checkpoints are published in (2 bytes per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig, RopeScaling

LLAMA31_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    config: ModelConfig
    source: str  # where the numbers come from

    @property
    def num_params(self) -> int:
        return num_params(self.config)


def num_params(c: ModelConfig) -> int:
    """Parameters of a Llama-family decoder from its shape (what its safetensors would hold):
    embeddings (+ an untied lm_head), per layer q/k/v/o (+ qkv bias), a gated MLP of three matrices,
    2 norms (4 with post-norms, + q/k norms of head_dim), and the final norm."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size
    if c.attention_bias:
        attention += q_dim + 2 * kv_dim
    mlp = 3 * c.hidden_size * c.intermediate_size
    norms = (4 if c.post_norms else 2) * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_layers * (attention + mlp + norms) + c.hidden_size


def _llama31(name: str, layers: int, hidden: int, intermediate: int, heads: int) -> Preset:
    config = ModelConfig(
        architecture="llama",
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE,
        tie_word_embeddings=False,
        name=name,
    )
    return Preset(name, config, f"meta-llama/{name} config.json")


def _gemma3(
    name: str,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int,
    vocab: int,
    max_ctx: int,
    query_pre_attn_scalar: int,
    rope_factor: float,
) -> Preset:
    config = ModelConfig(
        architecture="gemma3",
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max_ctx,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_theta_local=10000.0,
        rope_scaling=RopeScaling("linear", rope_factor) if rope_factor != 1.0 else RopeScaling(),
        sliding_window=window,
        sliding_window_layers=tuple((i + 1) % 6 != 0 for i in range(layers)),
        qk_norm=True,
        post_norms=True,
        hidden_act="gelu_tanh",
        embedding_scale=hidden**0.5,
        attn_scale=query_pre_attn_scalar**-0.5,
        tie_word_embeddings=True,
        name=name,
    )
    return Preset(name, config, f"google/{name.lower()}-it config.json (text_config)")


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _llama31("Llama-3.1-8B", 32, 4096, 14336, 32),
        _llama31("Llama-3.1-70B", 80, 8192, 28672, 64),
        Preset(
            "Qwen3-8B",
            ModelConfig(
                architecture="qwen3",
                num_layers=36,
                hidden_size=4096,
                intermediate_size=12288,
                num_heads=32,
                num_kv_heads=8,
                head_dim=128,
                vocab_size=151936,
                max_position_embeddings=40960,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                qk_norm=True,
                tie_word_embeddings=False,
                name="Qwen3-8B",
            ),
            "Qwen/Qwen3-8B config.json",
        ),
        Preset(
            "Mistral-7B",
            ModelConfig(  # v0.1: every layer attends to the last 4096 tokens only
                architecture="llama",
                num_layers=32,
                hidden_size=4096,
                intermediate_size=14336,
                num_heads=32,
                num_kv_heads=8,
                head_dim=128,
                vocab_size=32000,
                max_position_embeddings=32768,
                rms_norm_eps=1e-5,
                rope_theta=10000.0,
                sliding_window=4096,
                sliding_window_layers=(True,) * 32,
                tie_word_embeddings=False,
                name="Mistral-7B-v0.1",
            ),
            "mistralai/Mistral-7B-v0.1 config.json",
        ),
        # five sliding-window layers per global one; the 1B model's window is 512, the larger ones' 1024
        _gemma3("Gemma-3-1B", 26, 1152, 6912, 4, 1, 256, 512, 262144, 32768, 256, 1.0),
        _gemma3("Gemma-3-4B", 34, 2560, 10240, 8, 4, 256, 1024, 262208, 131072, 256, 8.0),
        _gemma3("Gemma-3-12B", 48, 3840, 15360, 16, 8, 256, 1024, 262208, 131072, 256, 8.0),
        _gemma3("Gemma-3-27B", 62, 5376, 21504, 32, 16, 128, 1024, 262208, 131072, 168, 8.0),
    )
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


_ALIASES = {_key(n): n for n in PRESETS} | {_key("Mistral-7B-v0.1"): "Mistral-7B"}


def find_preset(name: str) -> Preset | None:
    """The preset for a name, ignoring case, dashes and underscores (``llama-3.1-8b``, ``gemma3-4b``)."""
    canonical = _ALIASES.get(_key(name))
    return PRESETS[canonical] if canonical else None
