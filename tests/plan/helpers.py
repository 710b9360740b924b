from __future__ import annotations

from kvserve.config import ModelConfig


def llama(num_layers: int, num_kv_heads: int, head_dim: int = 128, num_heads: int = 32, **kw) -> ModelConfig:
    """A Llama-shaped config; the KV arithmetic reads layers, KV heads and head_dim."""
    fields = {
        "architecture": "llama",
        "num_layers": num_layers,
        "hidden_size": num_heads * head_dim,
        "intermediate_size": 4 * num_heads * head_dim,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    }
    return ModelConfig(**(fields | kw))


# name: (architecture, layers, hidden, intermediate, heads, kv_heads, head_dim, vocab,
# max_position_embeddings,
#        sliding_window, rope_theta, experts, experts per token, f16 KV bytes per token) as published
ARCH_PUBLISHED = {
    "Qwen3-0.6B": ("qwen3", 28, 1024, 3072, 16, 8, 128, 151936, 40960, None, 1e6, 0, 0, 114_688),
    "Qwen3-30B-A3B": ("qwen3moe", 48, 2048, 6144, 32, 4, 128, 151936, 40960, None, 1e6, 128, 8, 98_304),
    "Phi-3-mini-4k": ("phi3", 32, 3072, 8192, 32, 32, 96, 32064, 4096, 2047, 1e4, 0, 0, 393_216),
    "Phi-4-mini": ("phi3", 32, 3072, 8192, 24, 8, 128, 200064, 131072, None, 1e4, 0, 0, 131_072),
    "Phi-4": ("phi3", 40, 5120, 17920, 40, 10, 128, 100352, 16384, None, 250000.0, 0, 0, 204_800),
    "Gemma-2-2B": ("gemma2", 26, 2304, 9216, 8, 4, 256, 256000, 8192, 4096, 1e4, 0, 0, 106_496),
    "Gemma-2-9B": ("gemma2", 42, 3584, 14336, 16, 8, 256, 256000, 8192, 4096, 1e4, 0, 0, 344_064),
    "Gemma-2-27B": ("gemma2", 46, 4608, 36864, 32, 16, 128, 256000, 8192, 4096, 1e4, 0, 0, 376_832),
    "Granite-3.1-8B": ("granite", 40, 4096, 12800, 32, 8, 128, 49155, 131072, None, 1e7, 0, 0, 163_840),
    "OLMoE-1B-7B": ("olmoe", 16, 2048, 1024, 16, 16, 128, 50304, 4096, None, 1e4, 64, 8, 131_072),
}
