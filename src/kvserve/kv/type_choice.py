"""Choosing KV cache types for a memory budget, and advice that names the fix when something does not fit.

The quality order is measured, not guessed: mean KL divergence against the f32 cache from
``kvserve eval smollm2 --ctx 2048`` (see docs/kv-cache.md's table), best first. ``--cache-type auto`` takes
the first pair whose pool fits the budget. Torch-free.
"""

from __future__ import annotations

from kvserve.config import ModelConfig
from kvserve.kv.cache_types import kv_bytes_per_token
from kvserve.kv.pool_sizing import context_pool_bytes

# (K type, V type, measured KLD on SmolLM2 at 2,048 tokens)
QUALITY_ORDER: tuple[tuple[str, str, float], ...] = (
    ("f16", "f16", 0.0),
    ("bf16", "bf16", 0.00006),
    ("q8_0", "q8_0", 0.00042),
    ("q8_0", "tq4", 0.00583),
    ("q8_0", "q4_0", 0.00762),
    ("fp8", "fp8", 0.00944),
    ("q8_0", "tq3", 0.02175),
    ("tq4", "tq4", 0.06993),
    ("tq4", "tq3", 0.08641),
    ("q4_0", "q4_0", 0.10499),
    ("tq3", "tq3", 0.29617),
    ("tq2", "tq2", 1.14651),
)


def choose_cache_types(
    config: ModelConfig, num_ctx: int, max_num_seqs: int, block_size: int, budget: int,
    max_num_batched_tokens: int = 512, window_kv: bool = True,
) -> tuple[str, str, str]:
    """The best-measured (K, V) pair whose pool fits ``budget`` bytes, and a sentence saying why.
    Raises ValueError, with the numbers, when not even the smallest type fits."""
    tried = []
    for k, v, kld in QUALITY_ORDER:
        try:
            need = context_pool_bytes(config, num_ctx, max_num_seqs, block_size, k, v, max_num_batched_tokens,
                                      window_kv)
        except ValueError:  # this head_dim cannot use that type
            continue
        if need <= budget:
            skipped = f"; {tried[0][0]} would need {_mib(tried[0][1])}" if tried else ""
            reason = (f"K {k} / V {v} (KLD {kld:g} in our eval): {_mib(need)} for {max_num_seqs} x {num_ctx} "
                      f"tokens fits the {_mib(budget)} budget{skipped}")
            return k, v, reason
        tried.append((f"{k}/{v}", need))
    smallest = tried[-1] if tried else ("?", 0)
    raise ValueError(
        f"no KV cache type fits {max_num_seqs} x {num_ctx} tokens in {_mib(budget)} (even {smallest[0]} "
        f"needs "
        f"{_mib(smallest[1])}); lower --num-ctx or --max-num-seqs, or give more --kv-cache-memory"
    )


def context_advice(config: ModelConfig, num_tokens: int, k: str, v: str) -> str:
    """What to change so ``num_tokens`` fit one sequence: a --num-ctx and its KV cost per cache type."""
    num_ctx = max(1024, -(-(num_tokens + 256) // 1024) * 1024)
    costs = []
    for kk, vv in dict.fromkeys([(k, v), ("f16", "f16"), ("q8_0", "q8_0"), ("tq4", "tq4")]):
        try:
            costs.append(f"{_mib(num_ctx * kv_bytes_per_token(config, kk, vv))} with {kk}/{vv}")
        except ValueError:
            continue
    return f"use --num-ctx {num_ctx} (KV per sequence: {', '.join(costs)}) or a shorter prompt"


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
