"""Helpers shared by the test packages: tiny random models, engines, the greedy reference path and
the near-tie check."""

from __future__ import annotations

import json
import random

import torch

from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine


def write_tiny_llama(folder, seed: int = 0, vocab: int = 97, hidden: int = 64, layers: int = 2):
    """A random-weight LlamaForCausalLM folder (config.json + safetensors), no tokenizer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, inter = 4, 2, 128
    hd = hidden // heads

    def r(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"model.embed_tokens.weight": r(vocab, hidden, scale=1.0),
         "model.norm.weight": 1 + r(hidden, scale=0.1), "lm_head.weight": r(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(hidden, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + r(hidden, scale=0.1),
              p + "self_attn.q_proj.weight": r(heads * hd, hidden),
              p + "self_attn.k_proj.weight": r(kv_heads * hd, hidden),
              p + "self_attn.v_proj.weight": r(kv_heads * hd, hidden),
              p + "self_attn.o_proj.weight": r(hidden, heads * hd),
              p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
              p + "mlp.down_proj.weight": r(hidden, inter)}
    save_file(w, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def make_engine(loaded, *, num_ctx=1024, max_num_seqs=8, budget=512, block_size=16, prefix_caching=True,
                kv_cache_memory=None, cache_type_k="f32", cache_type_v=None, disk_cache_dir=None,
                disk_cache_size=1 << 30, window_kv=True) -> LLMEngine:
    config = EngineConfig(
        model=str(loaded.path),
        cache=CacheConfig(block_size, num_ctx, kv_cache_memory, prefix_caching, cache_type_k, cache_type_v,
                          None if disk_cache_dir is None else str(disk_cache_dir), disk_cache_size,
                          window_kv),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
    )
    return LLMEngine(config, loaded)


def recorded_steps(engine) -> list[tuple[list[str], torch.Tensor]]:
    """Wraps the engine's runner so each step's (ready request ids, logits) is kept."""
    steps = []
    execute = engine.runner.execute

    def recording(out):
        ready, logits = execute(out)
        steps.append(([r.request_id for r in ready], torch.from_numpy(logits.copy())))
        return ready, logits

    engine.runner.execute = recording
    return steps


def reference_greedy(loaded, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens from the contiguous (non-paged) path: whole prompt, then one token at a time."""
    model = loaded.model
    cache = ContiguousKVCache(loaded.config.num_layers)
    hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    out = []
    for _ in range(num_tokens):
        token = int(model.compute_logits(hidden[-1:]).argmax())
        out.append(token)
        pos = len(prompt) + len(out) - 1
        hidden = model.forward(torch.tensor([token]), torch.tensor([pos]), cache)
    return out


def top2_gap(loaded, tokens: list[int]) -> float:
    """Gap between the two largest next-token logits after ``tokens`` (reference path)."""
    cache = ContiguousKVCache(loaded.config.num_layers)
    hidden = loaded.model.forward(torch.tensor(tokens), torch.arange(len(tokens)), cache)
    top = loaded.model.compute_logits(hidden[-1:])[0].topk(2).values
    return float(top[0] - top[1])


NEAR_TIE = 1e-3


def assert_same_or_near_tie(loaded, prompt: list[int], expected: list[int], got: list[int]) -> None:
    """Exact match, or the first difference is a float near-tie in the reference (checked, not assumed)."""
    if got == expected:
        return
    i = next((j for j, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
             min(len(expected), len(got)))
    assert i < min(len(expected), len(got)), f"lengths differ: {len(expected)} vs {len(got)}"
    gap = top2_gap(loaded, prompt + expected[:i])
    assert gap < NEAR_TIE, (
        f"token {i} differs ({expected[i]} vs {got[i]}) and it is no near-tie: top-2 gap {gap}"
    )


# models/block_layouts.py's
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")


def random_blocks(type_name: str, rows: int, cols: int, seed: int):
    """rows x cols weights of GGUF ``type_name`` as file bytes: random codes and (6-bit or int8) scales,
    every f16 d (dmin, m) finite and small; uint8 [rows * bytes per row]."""
    import numpy as np

    from kvserve.models.block_layouts import GGUF_LAYOUTS

    _, per_block, size = GGUF_LAYOUTS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    halves = (rng.random((blocks.shape[0], 2)) * 0.02 + 1e-4).astype(np.float16).view(np.uint8)
    if type_name in ("Q6_K", "Q3_K"):  # d last
        blocks[:, -2:] = halves[:, :2]
    elif type_name == "Q2_K":  # d and dmin last
        blocks[:, -4:] = halves
    elif type_name in ("Q4_0", "Q5_0"):  # d first
        blocks[:, 0:2] = halves[:, :2]
    else:  # d and dmin (or m) first
        blocks[:, 0:4] = halves
    return blocks.reshape(-1)


def prompts_for(loaded, count: int, seed: int = 0) -> list[list[int]]:
    """Token prompts of varied lengths; half share a 40-token prefix so prefix caching has work."""
    rng = random.Random(seed)
    vocab = min(loaded.config.vocab_size, 5000)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(count):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))]
        out.append(shared + tail if i % 2 else tail)
    return out
