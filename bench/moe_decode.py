"""Decode speed of a mixture-of-experts model against a dense model of the same active parameter count.

Both are random Qwen3-family models written as Q4_1 GGUF files (every projection 4-bit, so ``--weights
q4`` runs them through the native 4-bit kernel): the MoE has ``--experts`` experts of ``--moe-inter``
per layer, ``--top-k`` chosen per token; the dense model's MLP is top_k * moe_inter wide, so a token
multiplies by the same number of weights in both. The MoE holds experts / top_k times the MLP weights
but should read only the chosen ones a step: its decode tok/s over the dense model's is what that
costs (routing, one matmul per chosen expert instead of one per layer).

    .venv/bin/python bench/moe_decode.py [--layers 8] [--hidden 1024] [--experts 32] [--top-k 4]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve import LLM, SamplingParams

Q4_1 = gguf.GGMLQuantizationType.Q4_1


def write_model(path: Path, a, moe: bool) -> Path:
    """A random Qwen3 (dense) or Qwen3-MoE GGUF: byte tokens, Q4_1 projections, f32 norms and router."""
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, vocab = a.hidden // 64, max(1, a.hidden // 256), 64, 4096
    arch = "qwen3moe" if moe else "qwen3"
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_block_count, a.layers), (w.add_context_length, 4096),
                       (w.add_embedding_length, a.hidden), (w.add_feed_forward_length, a.top_k * a.moe_inter),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_key_length, head_dim), (w.add_value_length, head_dim),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 1e6)):
        add(value)
    if moe:
        w.add_expert_count(a.experts)
        w.add_expert_used_count(a.top_k)
        w.add_expert_feed_forward_length(a.moe_inter)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<{i}>" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    def q4(name: str, t: np.ndarray) -> None:
        w.add_tensor(name, gguf.quants.quantize(t, Q4_1), raw_dtype=Q4_1)

    w.add_tensor("token_embd.weight", rand(vocab, a.hidden))
    w.add_tensor("output_norm.weight", np.ones(a.hidden, np.float32))
    for i in range(a.layers):
        b = f"blk.{i}."
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            q4(b + name + ".weight", rand(rows, a.hidden))
        q4(b + "attn_output.weight", rand(a.hidden, heads * head_dim))
        for name, size in (("attn_norm", a.hidden), ("ffn_norm", a.hidden), ("attn_q_norm", head_dim),
                           ("attn_k_norm", head_dim)):
            w.add_tensor(b + name + ".weight", np.ones(size, np.float32))
        if moe:
            w.add_tensor(b + "ffn_gate_inp.weight", rand(a.experts, a.hidden))
            q4(b + "ffn_gate_exps.weight", rand(a.experts, a.moe_inter, a.hidden))
            q4(b + "ffn_up_exps.weight", rand(a.experts, a.moe_inter, a.hidden))
            q4(b + "ffn_down_exps.weight", rand(a.experts, a.hidden, a.moe_inter))
        else:
            inter = a.top_k * a.moe_inter
            q4(b + "ffn_gate.weight", rand(inter, a.hidden))
            q4(b + "ffn_up.weight", rand(inter, a.hidden))
            q4(b + "ffn_down.weight", rand(a.hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def decode_tok_s(path: Path, a) -> list[float]:
    llm = LLM(str(path), weights="q4", num_ctx=1024, max_num_seqs=1)
    prompt = list(range(1, 65))
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: kernels built, buffers planned
    return [llm.generate([prompt], params)[0].metrics.decode_tok_s for _ in range(a.repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dense = write_model(Path(tmp) / "dense.gguf", a, moe=False)
        moe = write_model(Path(tmp) / "moe.gguf", a, moe=True)
        rates = {}
        for name, path in (("dense", dense), ("moe", moe), ("dense ", dense), ("moe ", moe)):  # alternating
            rates.setdefault(name.strip(), []).extend(decode_tok_s(path, a))
    mlp = 3 * a.hidden * a.top_k * a.moe_inter * a.layers
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; {a.layers} "
        f"layers, "
          f"hidden {a.hidden}; active MLP weights {mlp / 1e6:.1f} M in both, MoE holds "
          f"{a.experts // a.top_k}x "
          f"({a.experts} experts, top {a.top_k})")
    for name, values in rates.items():
        print(
            f"{name:5s} decode tok/s: median {np.median(values):.1f}  (runs: "
            f"{', '.join(f'{v:.1f}' for v in values)})")
    print(f"MoE / dense: {np.median(rates['moe']) / np.median(rates['dense']):.2f}")


if __name__ == "__main__":
    main()
