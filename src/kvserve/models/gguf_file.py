"""Read a GGUF file with the `gguf` library: metadata into a ``ModelConfig``, tensors into torch.

Tensor names stay in GGUF spelling (``token_embd.weight``, ``blk.3.attn_q.weight``); the HF loader
maps its names onto the same spelling, so the model code knows one set of names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")


class GGUFFile:
    """An opened GGUF file: typed metadata access and lazy tensor dequantization."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{self.path}: not a GGUF file (it does not start with the GGUF magic)")
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:  # the library raises many kinds on truncated or corrupt files
            raise ModelLoadError(f"{self.path}: malformed or truncated GGUF file ({e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks '{key}'")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def tensor_type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def load_tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32, in torch layout ([out, in] for matrices)."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported type {t.tensor_type.name}")
        try:
            array = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{self.path}: cannot read tensor {name} ({e}); is the file truncated?") from None
        shape = tuple(int(d) for d in reversed(t.shape))
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))


def read_model_config(gf: GGUFFile) -> ModelConfig:
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gf.path}: architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(name: str, default: Any = None) -> Any:
        return gf.get(f"{arch}.{name}", default)

    num_heads = int(gf.require(f"{arch}.attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer lists exist in some files; we need one value
        num_kv_heads = max(num_kv_heads)
    hidden = int(gf.require(f"{arch}.embedding_length"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    vocab = key("vocab_size") or len(gf.get("tokenizer.ggml.tokens", []) or [])
    if not vocab and "token_embd.weight" in gf.tensors:
        vocab = int(gf.tensors["token_embd.weight"].shape[1])
    num_layers = int(gf.require(f"{arch}.block_count"))
    scaling = _rope_scaling(gf, arch)
    fields: dict[str, Any] = dict(
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(gf.require(f"{arch}.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in gf.tensors,
        name=str(gf.get("general.name", "") or ""),
    )
    if arch == "qwen2":
        fields["attention_bias"] = True
        fields["rope_theta"] = float(key("rope.freq_base", 1000000.0))
    if arch == "gemma3":
        window = int(key("attention.sliding_window", 512))
        pattern = 6  # five local layers, then one global
        fields.update(
            qk_norm=True,
            post_norms=True,
            hidden_act="gelu_tanh",
            embedding_scale=float(hidden) ** 0.5,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            sliding_window=window,
            sliding_window_layers=tuple((i + 1) % pattern != 0 for i in range(num_layers)),
            rope_theta=float(key("rope.freq_base", 1000000.0)),
            rope_theta_local=10000.0,
            attn_scale=float(head_dim) ** -0.5,
        )
    return ModelConfig(**fields)


def _rope_scaling(gf: GGUFFile, arch: str) -> RopeScaling:
    kind = gf.get(f"{arch}.rope.scaling.type")
    factor = gf.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return RopeScaling(rope_type="linear", factor=float(factor))
    # Llama 3.x GGUFs carry precomputed frequency factors (rope_freqs.weight) instead of metadata
    return RopeScaling()


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved -> half-split RoPE layout).

    The converter stores row (head, half, i) at (head, i, half) so that llama.cpp can rotate adjacent
    pairs. We rotate halves (like the reference implementation), so we put the rows back.
    """
    out_dim = w.shape[0]
    rest = w.shape[1:]
    half = out_dim // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(out_dim, *rest).contiguous()


def load_gguf_weights(
    gf: GGUFFile, config: ModelConfig, on_tensor: Callable[[int, int], None] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors, dequantized, with architecture-specific fix-ups applied."""
    weights: dict[str, torch.Tensor] = {}
    names = list(gf.tensors)
    for i, name in enumerate(names):
        w = gf.load_tensor(name)
        if config.architecture == "llama":
            if name.endswith("attn_q.weight"):
                w = unpermute_rope_rows(w, config.num_heads)
            elif name.endswith("attn_k.weight"):
                w = unpermute_rope_rows(w, config.num_kv_heads)
        weights[name] = w
        if on_tensor:
            on_tensor(i + 1, len(names))
    if "rope_freqs.weight" in weights:
        weights["rope_freqs"] = weights.pop("rope_freqs.weight")
    return weights
