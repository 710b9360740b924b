"""``--cache-type auto`` and ``--kv-cache-memory auto``: settle them from the model's header and this
machine's memory before any weight is loaded, and say what was picked and why.

    budget (auto)  = MemAvailable - weights as the engine holds them - activations of one step
                     - runtime overhead, less a 10% margin
    --kv-cache-memory auto   the pool for --num-ctx x --max-num-seqs if it fits the budget; otherwise as
                             many blocks as fit (the usable context shrinks, and we say so)
    --cache-type auto        the best-measured K/V pair (kv.type_choice.QUALITY_ORDER) whose pool fits
                             the budget (or the --kv-cache-memory bytes given)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.type_choice import choose_cache_types, context_pool_bytes
from kvserve.plan.model_spec import resolve_model
from kvserve.plan.planner import (
    DTYPE_BYTES,
    RUNTIME_OVERHEAD_BYTES,
    PlanSettings,
    activations,
    available_memory,
)

SAFETY = 0.9


@dataclass(frozen=True, slots=True)
class AutoCache:
    cache_type_k: str
    cache_type_v: str
    kv_cache_memory: int | None
    message: str


def memory_budget(model: str, num_ctx: int, max_num_seqs: int, max_num_batched_tokens: int,
                  dtype: str) -> tuple[int, str]:
    """Bytes left for the KV pool on this machine, and how that was worked out."""
    spec = resolve_model(model)
    available, source = available_memory()
    weights = spec.num_params * DTYPE_BYTES[dtype]
    settings = PlanSettings(contexts=(num_ctx,), kv_types=(("f16", "f16"),), memory=max(available, 1),
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            dtype=dtype)
    act = activations(spec.config, num_ctx, "f16", "f16", settings).total
    budget = int(SAFETY * (available - weights - act - RUNTIME_OVERHEAD_BYTES))
    how = (f"{source} {available / 2**30:.2f} GiB - weights {weights / 2**30:.2f} GiB - activations "
           f"{act / 2**30:.2f} GiB - overhead {RUNTIME_OVERHEAD_BYTES / 2**20:.0f} MiB, x{SAFETY}")
    if budget <= 0:
        raise ValueError(f"no memory is left for a KV cache ({how}); free memory or use a smaller model")
    return budget, how


def resolve_auto(
    model: str, num_ctx: int, max_num_seqs: int, block_size: int, max_num_batched_tokens: int, dtype: str,
    cache_type_k: str, cache_type_v: str, kv_cache_memory: int | str | None, window_kv: bool = True,
) -> AutoCache:
    config = resolve_model(model).config
    notes = []
    budget = kv_cache_memory if isinstance(kv_cache_memory, int) else None
    if budget is None and (kv_cache_memory == "auto" or "auto" in (cache_type_k, cache_type_v)):
        budget, how = memory_budget(model, num_ctx, max_num_seqs, max_num_batched_tokens, dtype)
        notes.append(f"KV budget {budget / 2**20:.0f} MiB ({how})")
    if "auto" in (cache_type_k, cache_type_v):
        cache_type_k, cache_type_v, reason = choose_cache_types(config, num_ctx, max_num_seqs, block_size,
                                                                budget, max_num_batched_tokens, window_kv)
        notes.append(f"--cache-type auto picked {reason}")
    if kv_cache_memory == "auto":
        need = context_pool_bytes(config, num_ctx, max_num_seqs, block_size, cache_type_k, cache_type_v,
                                  max_num_batched_tokens, window_kv)
        kv_cache_memory = min(need, budget)
        if need > budget:
            notes.append(f"--kv-cache-memory auto: the pool for {max_num_seqs} x {num_ctx} tokens needs "
                         f"{need / 2**20:.0f} MiB; using {budget / 2**20:.0f} MiB, so the context shrinks "
                         f"(a quantized --cache-type or a smaller --num-ctx would keep it)")
        else:
            notes.append(
                f"--kv-cache-memory auto: {need / 2**20:.0f} MiB for {max_num_seqs} x {num_ctx} tokens")
    return AutoCache(cache_type_k, cache_type_v, kv_cache_memory, "; ".join(notes))
