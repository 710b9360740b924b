"""Models people ask about, described by their published Hugging Face ``config.json`` values.

A preset is a ``ModelConfig`` (the text model only: Gemma 3's 4B/12B/27B vision towers are left out)
plus its parameter count from the Llama-family formula (experts counted for MoE models); its weights
are planned at bf16, the type the checkpoints are published in (2 bytes per parameter).
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
    if c.num_experts:  # every expert's gate, up and down, and the router
        mlp = c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size + c.num_experts * c.hidden_size
    qk_norms = 2 * c.head_dim if c.qk_norm_per_head else q_dim + kv_dim
    norms = (4 if c.post_norms else 2) * c.hidden_size + (qk_norms if c.qk_norm else 0)
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


def _preset(name: str, source: str, **fields) -> Preset:
    """A preset from its config.json values (ModelConfig's names; Llama defaults for the rest)."""
    return Preset(name, ModelConfig(name=name, **fields), f"{source} config.json")


def _gemma2(name: str, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
            query_pre_attn_scalar: int) -> Preset:
    return _preset(
        name, f"google/{name.lower()}", architecture="gemma2", num_layers=layers, hidden_size=hidden,
        intermediate_size=intermediate, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=4096,
        sliding_window_layers=tuple(i % 2 == 0 for i in range(layers)), post_norms=True,
        hidden_act="gelu_tanh", embedding_scale=hidden**0.5, attn_scale=query_pre_attn_scalar**-0.5,
        attn_logit_softcap=50.0, final_logit_softcap=30.0, tie_word_embeddings=True)


_MORE = (
    _preset("Qwen3-0.6B", "Qwen/Qwen3-0.6B", architecture="qwen3", num_layers=28, hidden_size=1024,
            intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128, vocab_size=151936,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
            tie_word_embeddings=True),
    _preset("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", architecture="qwen3moe", num_layers=48, hidden_size=2048,
            intermediate_size=6144, num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
            tie_word_embeddings=False),
    _preset("Phi-3-mini-4k", "microsoft/Phi-3-mini-4k-instruct", architecture="phi3", num_layers=32,
            hidden_size=3072, intermediate_size=8192, num_heads=32, num_kv_heads=32, head_dim=96,
            vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
            sliding_window=2047, sliding_window_layers=(True,) * 32, tie_word_embeddings=False),
    _preset("Phi-4-mini", "microsoft/Phi-4-mini-instruct", architecture="phi3", num_layers=32,
            hidden_size=3072, intermediate_size=8192, num_heads=24, num_kv_heads=8, head_dim=128,
            vocab_size=200064, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000.0,
            rotary_dim=96, rope_scaling=RopeScaling("longrope", 32.0, original_max_position_embeddings=4096),
            tie_word_embeddings=True),
    _preset("Phi-4", "microsoft/phi-4", architecture="phi3", num_layers=40, hidden_size=5120,
            intermediate_size=17920, num_heads=40, num_kv_heads=10, head_dim=128, vocab_size=100352,
            max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=250000.0, tie_word_embeddings=False),
    _gemma2("Gemma-2-2B", 26, 2304, 9216, 8, 4, 256, 256),
    _gemma2("Gemma-2-9B", 42, 3584, 14336, 16, 8, 256, 256),
    _gemma2("Gemma-2-27B", 46, 4608, 36864, 32, 16, 128, 144),
    _preset("Granite-3.1-8B", "ibm-granite/granite-3.1-8b-instruct", architecture="granite", num_layers=40,
            hidden_size=4096, intermediate_size=12800, num_heads=32, num_kv_heads=8, head_dim=128,
            vocab_size=49155, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0,
            embedding_scale=12.0, residual_scale=0.22, attn_scale=0.0078125, logits_divisor=16.0,
            tie_word_embeddings=True),
    _preset("OLMoE-1B-7B", "allenai/OLMoE-1B-7B-0924", architecture="olmoe", num_layers=16, hidden_size=2048,
            intermediate_size=1024, num_heads=16, num_kv_heads=16, head_dim=128, vocab_size=50304,
            max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, qk_norm=True,
            qk_norm_per_head=False, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
            tie_word_embeddings=False),
)


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
        *_MORE,
    )
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


_ALIASES = {_key(n): n for n in PRESETS} | {_key("Mistral-7B-v0.1"): "Mistral-7B"}


def find_preset(name: str) -> Preset | None:
    """The preset for a name, ignoring case, dashes and underscores (``llama-3.1-8b``, ``gemma3-4b``)."""
    canonical = _ALIASES.get(_key(name))
    return PRESETS[canonical] if canonical else None
