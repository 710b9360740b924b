"""Frozen configuration records. One tree flows from the CLI down to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: Llama 3's, linear, YaRN's, or Phi-3's LongRoPE (models.rope)."""

    rope_type: str = "none"  # "none" | "linear" | "llama3" | "yarn" | "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float | None = None  # yarn / longrope: cos and sin scaled (None: from factor)
    beta_fast: float = 32.0  # yarn: the rotations below which frequencies are interpolated
    beta_slow: float = 1.0
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the original context
    long_factor: tuple[float, ...] = ()  # longrope: beyond it


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the forward pass needs to know about a decoder-only transformer.

    The defaults describe a Llama: variants (qwen2, gemma3) only switch fields on.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_theta_local: float | None = None  # rope base of sliding-window layers (gemma3)
    sliding_window: int | None = None
    sliding_window_layers: tuple[bool, ...] = ()  # per layer: True = sliding window attention
    attention_bias: bool = False  # qwen2: bias on q, k, v projections
    qk_norm: bool = False  # gemma3: RMSNorm on q and k per head
    post_norms: bool = False  # gemma3: norms after attention and after the MLP
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    embedding_scale: float = 1.0  # gemma: hidden states scaled by sqrt(hidden_size) after embedding
    attn_scale: float | None = None  # default 1/sqrt(head_dim)
    tie_word_embeddings: bool = True
    name: str = ""
    # the architectures beyond the Llama family (models.arch describes which sets what)
    qk_norm_per_head: bool = True  # olmoe: q and k normalized over the whole projection instead
    rotary_dim: int | None = None  # phi3 / partial rotary: dims of each head rotated (None: all)
    attn_logit_softcap: float | None = None  # gemma2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # gemma2: the same on the output logits
    residual_scale: float = 1.0  # granite: each block's output scaled before the residual add
    logits_divisor: float = 1.0  # granite: logits divided by this
    num_experts: int = 0  # mixture of experts (qwen3moe, olmoe): 0 = a dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalized to sum to 1

    @property
    def kv_size_per_token(self) -> int:
        """Elements of K plus V stored per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window_layers) and self.sliding_window_layers[layer]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV pool. Its size comes from ``num_ctx`` (tokens per sequence, Ollama-like)
    times ``max_num_seqs``, or from ``kv_cache_memory`` bytes (vLLM-like) when that is set."""

    block_size: int = 16
    num_ctx: int = 4096
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    cache_type_k: str = "f32"
    cache_type_v: str | None = None  # None: same as cache_type_k
    disk_cache_dir: str | None = None  # the prefix cache's disk tier (kv.disk_tier); None: RAM only
    disk_cache_size: int = 8 << 30  # bytes the disk tier's directory may hold
    # sliding-window layers keep only their window (kv.groups); False: every layer every token
    window_kv: bool = True

    @property
    def cache_type_v_resolved(self) -> str:
        return self.cache_type_v or self.cache_type_k


CONTEXT_OVERFLOW = ("error", "shift")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    # a request that outgrows the context: "error" ends it (length) and refuses too long a prompt;
    # "shift" keeps its first num_keep tokens, drops the older half of the rest and goes on
    context_overflow: str = "error"
    num_keep: int = 4  # Ollama's default

    def __post_init__(self) -> None:
        if self.context_overflow not in CONTEXT_OVERFLOW:
            raise ValueError(
                f"--context-overflow must be one of {', '.join(CONTEXT_OVERFLOW)}, got "
                f"{self.context_overflow!r}")
        if self.num_keep < 0:
            raise ValueError(f"num_keep must be >= 0, got {self.num_keep}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: ``method`` "ngram" proposes the tokens that followed the last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens where they occurred before (prompt lookup);
    "draft" the greedy guesses of ``draft_model``, a smaller model with the same tokenizer. Up to
    ``num_speculative_tokens`` of them are verified in one step. None: off."""

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.method!r}; use 'ngram' or 'draft'")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(
                "--speculative draft needs --draft-model, and --draft-model goes with --speculative draft")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= --prompt-lookup-min <= --prompt-lookup-max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")


WEIGHT_CHOICES = ("auto", "q4", "q4-fast", "int8", "bf16", "f32")  # see models.linear


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: str = "auto"
    dtype: str = "float32"
    # weight format of the projections: auto | f32 | bf16 | int8 | q4 | q4-fast (models.linear)
    weights: str = "auto"
    num_threads: int | None = None
    seed: int = 0
