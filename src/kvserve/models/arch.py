"""How each supported architecture differs from a Llama, in one table (as llama.cpp's and mlx-lm's
arch tables do). Torch-free: the planner and both config readers use it.

One ``DecoderLM`` runs every entry; an entry only switches ``ModelConfig`` fields on and says how the
files spell things. Numbers (softcaps, multipliers, windows, expert counts) come from each file.

    arch      norms                     attention                         MLP
    llama     pre                       GQA, RoPE (Mistral: a window)     SwiGLU
    qwen2     pre                       + q/k/v bias                      SwiGLU
    qwen3     pre                       + RMSNorm on q, k per head        SwiGLU
    phi3      pre                       fused qkv, partial/LongRoPE       fused gate_up
    granite   pre                       scale given                       SwiGLU; multipliers on
                                                                          embedding, residual, logits
    gemma2    pre + post, (1 + w)       soft-capped scores, every other   GELU; logits soft-capped
                                        layer sliding
    gemma3    pre + post, (1 + w)       + q/k norm, 5 sliding : 1 global  GELU
    qwen3moe  pre                       as qwen3                          top-k experts (renormalized)
    olmoe     pre                       + RMSNorm on all of q, all of k   top-k experts
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArchSpec:
    name: str  # GGUF's general.architecture, and ModelConfig.architecture
    hf_classes: tuple[str, ...]  # config.json "architectures" entries read as this arch
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved the q/k rows (undone at load)
    attention_bias: bool = False
    qk_norm: str = ""  # "" | "head" (per head, head_dim weights) | "full" (over the projection)
    post_norms: bool = False  # norms after attention and after the MLP too
    hidden_act: str = "silu"
    gemma_norms: bool = False  # HF stores w of (1 + w) scales; GGUF stores 1 + w
    embedding_scale_sqrt: bool = False  # hidden states times sqrt(hidden_size) after the embedding
    sliding: str = ""  # which layers slide when the file names a window: "all" | "even" | "gemma3"
    moe: bool = False
    rope_theta: float = 10000.0  # when the file names none
    rms_norm_eps: float = 1e-5


ARCHS: dict[str, ArchSpec] = {
    s.name: s
    for s in (
        ArchSpec("llama", ("LlamaForCausalLM", "MistralForCausalLM"), gguf_permuted_qk=True, sliding="all"),
        ArchSpec("qwen2", ("Qwen2ForCausalLM",), attention_bias=True, rope_theta=1e6),
        ArchSpec("qwen3", ("Qwen3ForCausalLM",), qk_norm="head", rope_theta=1e6, rms_norm_eps=1e-6),
        ArchSpec("phi3", ("Phi3ForCausalLM",), sliding="all"),
        ArchSpec("granite", ("GraniteForCausalLM",), gguf_permuted_qk=True),
        ArchSpec("gemma2", ("Gemma2ForCausalLM",), post_norms=True, hidden_act="gelu_tanh", gemma_norms=True,
                 embedding_scale_sqrt=True, sliding="even", rms_norm_eps=1e-6),
        ArchSpec("gemma3", ("Gemma3ForCausalLM",), qk_norm="head", post_norms=True, hidden_act="gelu_tanh",
                 gemma_norms=True, embedding_scale_sqrt=True, sliding="gemma3", rope_theta=1e6,
                 rms_norm_eps=1e-6),
        ArchSpec("qwen3moe", ("Qwen3MoeForCausalLM",), qk_norm="head", moe=True, rope_theta=1e6,
                 rms_norm_eps=1e-6),
        ArchSpec("olmoe", ("OlmoeForCausalLM",), qk_norm="full", moe=True),
    )
}
SUPPORTED_ARCHITECTURES = tuple(ARCHS)
HF_CLASSES = {cls: spec.name for spec in ARCHS.values() for cls in spec.hf_classes}


def sliding_layers(spec: ArchSpec, num_layers: int, window: int | None) -> tuple[bool, ...]:
    """Per layer, whether it attends within the window (none without a window)."""
    if not window or not spec.sliding:
        return ()
    if spec.sliding == "even":  # gemma2: layers 0, 2, 4, ... local, the others global
        return tuple(i % 2 == 0 for i in range(num_layers))
    if spec.sliding == "gemma3":  # five local layers, then one global
        return tuple((i + 1) % 6 != 0 for i in range(num_layers))
    return (True,) * num_layers


def switches(spec: ArchSpec, hidden_size: int) -> dict:
    """The ModelConfig fields an architecture sets whatever its file says."""
    fields: dict = {
        "architecture": spec.name, "attention_bias": spec.attention_bias, "qk_norm": bool(spec.qk_norm),
        "qk_norm_per_head": spec.qk_norm != "full", "post_norms": spec.post_norms,
        "hidden_act": spec.hidden_act,
    }
    if spec.embedding_scale_sqrt:
        fields["embedding_scale"] = float(hidden_size) ** 0.5
    return fields
