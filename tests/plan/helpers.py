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
