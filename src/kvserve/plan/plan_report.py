"""A plan as a rich table for people, or as JSON with the same numbers (all sizes in bytes).

JSON keys::

    model      name, source, architecture, num_layers, num_heads, num_kv_heads, head_dim, hidden_size,
               intermediate_size, vocab_size, max_position_embeddings, sliding_window (null if none),
               num_sliding_layers
    settings   contexts, max_num_seqs, max_num_batched_tokens, block_size, dtype, memory_bytes, memory_source,
               disk_cache_bytes, window_kv (false: --no-window-kv)
    weights    num_params, stored_bytes, stored_by_type {type: bytes}, engine_bytes (dequantized to dtype),
               engine_dtype
    runtime_overhead_bytes
    kv_types   one per planned type: name, cache_type_k, cache_type_v, bits_per_element_k/_v, bytes_per_token,
               max_ctx (plan), engine_max_ctx (engine), contexts: one per ctx with
               ctx, kv_bytes (every token in every layer), kv_bytes_windowed (the least: sliding layers
               hold min(ctx, window) tokens), engine_kv_pool_bytes (the pool the engine allocates, in both
               totals), engine_pool_blocks (per layer outside the window group), engine_window_blocks (per
               sliding layer in the window group; 0: no window group at this ctx), activations
               {hidden_states, attention, logits, total, attention_path ("prefill" or "decode", the
               larger)}, total_bytes (plan: weights as stored), engine_total_bytes (engine: weights as
               held), fits, engine_fits
    skipped_kv_types  [{name, reason}] for types that cannot store this model's head-vectors
    notes      the sentences printed under the table
"""

from __future__ import annotations

from typing import Any

from kvserve.models.gguf_config import SUPPORTED_ARCHITECTURES
from kvserve.plan.planner import ContextPlan, Plan, tokenizer_bytes_per_token, weight_format

UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def fmt_bytes(n: int) -> str:
    for unit, size in UNITS:
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_bits(bits: float) -> str:
    return f"{bits:g}"


def _num_sliding(plan: Plan) -> int:
    c = plan.model.config
    return sum(1 for i in range(c.num_layers) if c.is_sliding(i)) if c.sliding_window else 0


def _windowed(plan: Plan) -> list[ContextPlan]:
    """The planned contexts (of the leading KV type) where the engine pools a window group."""
    return [p for p in _leading(plan).contexts if p.engine_pool.window_layers]


def _leading(plan: Plan):
    return next((t for t in plan.kv if t.name == "f16"), plan.kv[0])  # the engine's default type leads


def sliding_note(plan: Plan) -> str:
    """How the engine keeps the sliding-window layers' K/V, and what that saves."""
    c, s = plan.model.config, plan.settings
    head = (
        f"{_num_sliding(plan)} of {c.num_layers} layers attend to a {c.sliding_window}-token sliding window: "
    )
    if _num_sliding(plan) == c.num_layers:
        return (
            head + "every layer keeps every token (a window group needs global layers to tie its blocks to)"
        )
    if not s.window_kv:
        return head + "--no-window-kv keeps every token in every layer"
    windowed = _windowed(plan)
    if not windowed:
        return head + "every layer keeps every token at these contexts (a window pool would be no smaller)"
    last = windowed[-1]
    seqs = f"{s.max_num_seqs} sequence" + ("s" if s.max_num_seqs > 1 else "")
    return (
        head + f"the engine keeps them in a pool of their own, {last.engine_pool.num_window_blocks} blocks "
               f"of "
        f"{s.block_size} tokens per layer (the windows of {seqs} and one step's {s.max_num_batched_tokens} "
        f"tokens)"
        + ("" if len(windowed) == len(s.contexts) else
           f", from ctx {windowed[0].ctx:,} on (below, a window pool would be no smaller)")
        + f"; at ctx {last.ctx:,} the KV cache is {fmt_bytes(last.engine_kv_pool_bytes)} instead of "
        f"{fmt_bytes(last.kv_bytes)} (--no-window-kv: every token in every layer)"
    )


def notes(plan: Plan) -> list[str]:
    c, s, m = plan.model.config, plan.settings, plan.model
    out = []
    if c.architecture not in SUPPORTED_ARCHITECTURES:
        out.append(
            f"the engine does not run architecture '{c.architecture}' yet (it runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); the figures assume its Llama-style layout"
        )
    fmt = weight_format(m, s)
    if m.stored_bytes != plan.engine_weight_bytes:
        out.append(
            f"weights: {fmt_bytes(m.stored_bytes)} as stored; the engine line counts them as --weights {fmt} "
            f"holds them, {fmt_bytes(plan.engine_weight_bytes)} ({m.num_params:,} parameters"
            + ("; 4-bit tensors as 4-bit groups, the rest and the head as int8 groups, norms in f32)"
               if fmt in ("q4", "q4-fast", "int8") and m.tensors else ")")
        )
    if _num_sliding(plan):
        out.append(sliding_note(plan))
    out.append(
        f"runtime overhead: {fmt_bytes(plan.runtime_overhead)}, the resident size of "
        '`python -c "import torch, kvserve"` (CPU build; CUDA adds its context) and the tokenizer\'s tables '
        f"(~{tokenizer_bytes_per_token(plan.model)} bytes for each of {c.vocab_size:,} tokens)"
    )
    kernels = plan.kv[0].contexts[0].activations.attention_kernels
    out.append(
        f"activations: one step of at most {s.max_num_batched_tokens} tokens (--max-num-batched-tokens), "
        f"{s.dtype}; "
        + ("the native attention kernels read K/V blocks in place: their workspace grows with ctx only by "
           "a softmax state per 256 positions of each decoding sequence (--attention torch plans torch's "
           "path)"
           if kernels == "native" else
           "torch's attention: scores of one query tile and the K/V gathered for attention grow with ctx")
    )
    too_long = [ctx for ctx in s.contexts if ctx > c.max_position_embeddings]
    if too_long:
        out.append(
            f"ctx {', '.join(f'{x:,}' for x in too_long)} beyond the model's trained context "
            f"{c.max_position_embeddings:,}; largest-context figures stop at {c.max_position_embeddings:,}"
        )
    if s.disk_cache_bytes:
        out.append(
            f"disk tier: {fmt_bytes(s.disk_cache_bytes)} of block files (--kv-disk-cache-size) hold the "
            f"tokens "
            "of the 'disk tier' column; not counted in memory (the OS caches what it can in free RAM)"
        )
    out += [f"KV type {name} skipped: {why}" for name, why in plan.skipped]
    return out


def to_json(plan: Plan) -> dict[str, Any]:
    c, s, m = plan.model.config, plan.settings, plan.model
    return {
        "model": {
            "name": m.name,
            "source": m.source,
            "architecture": c.architecture,
            "num_layers": c.num_layers,
            "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "sliding_window": c.sliding_window,
            "num_sliding_layers": _num_sliding(plan),
        },
        "settings": {
            "contexts": list(s.contexts),
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "block_size": s.block_size,
            "dtype": s.dtype,
            "memory_bytes": s.memory,
            "memory_source": s.memory_source,
            "disk_cache_bytes": s.disk_cache_bytes,
            "window_kv": s.window_kv,
        },
        "weights": {
            "num_params": m.num_params,
            "stored_bytes": m.stored_bytes,
            "stored_by_type": dict(m.stored_by_type),
            "engine_bytes": plan.engine_weight_bytes,
            "engine_dtype": s.dtype,
            "engine_format": weight_format(plan.model, s),
        },
        "runtime_overhead_bytes": plan.runtime_overhead,
        "kv_types": [
            {
                "name": t.name,
                "cache_type_k": t.cache_type_k,
                "cache_type_v": t.cache_type_v,
                "bits_per_element_k": t.bits_per_element_k,
                "bits_per_element_v": t.bits_per_element_v,
                "bytes_per_token": t.bytes_per_token,
                "max_ctx": t.max_ctx,
                "engine_max_ctx": t.engine_max_ctx,
                "disk_tier": None if not s.disk_cache_bytes else dict(
                    zip(("file_bytes", "tokens"), t.disk_tier(s.disk_cache_bytes, s.block_size),
                        strict=True)),
                "contexts": [
                    {
                        "ctx": p.ctx,
                        "kv_bytes": p.kv_bytes,
                        "kv_bytes_windowed": p.kv_bytes_windowed,
                        "engine_kv_pool_bytes": p.engine_kv_pool_bytes,
                        "engine_pool_blocks": p.engine_pool.num_blocks,
                        "engine_window_blocks": p.engine_pool.num_window_blocks,
                        "activations": {
                            "hidden_states": p.activations.hidden_states,
                            "attention": p.activations.attention,
                            "logits": p.activations.logits,
                            "total": p.activations.total,
                            "attention_path": p.activations.attention_path,
                            "attention_kernels": p.activations.attention_kernels,
                        },
                        "total_bytes": p.total,
                        "engine_total_bytes": p.engine_total,
                        "fits": p.total <= s.memory,
                        "engine_fits": p.engine_total <= s.memory,
                    }
                    for p in t.contexts
                ],
            }
            for t in plan.kv
        ],
        "skipped_kv_types": [{"name": name, "reason": why} for name, why in plan.skipped],
        "notes": notes(plan),
    }


def _max_ctx(n: int, limit: int) -> str:
    if n == 0:
        return "does not fit"
    return f"{n:,} (model max)" if n == limit else f"{n:,}"


def render(plan: Plan, console) -> None:
    from rich import box
    from rich.table import Table

    c, s, m = plan.model.config, plan.settings, plan.model
    seqs = f"x{s.max_num_seqs} seq" + ("s" if s.max_num_seqs > 1 else "")
    console.print(
        f"[bold]{m.name}[/bold] · {c.architecture} · {c.num_layers} layers · {c.num_heads} heads, "
        f"{c.num_kv_heads} KV heads x {c.head_dim} · vocab {c.vocab_size:,} · "
        f"trained context {c.max_position_embeddings:,}"
    )
    console.print(f"[dim]from {m.source}[/dim]")
    first = _leading(plan)
    ctx_headers = [f"ctx {p.ctx:,}" for p in first.contexts]
    table = Table(
        "",
        *ctx_headers,
        "",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        title=f"memory with KV cache {first.name}, {seqs}",
    )
    for i in range(1, len(ctx_headers) + 1):
        table.columns[i].justify = "right"
    stored = " + ".join(f"{t} {fmt_bytes(b)}" for t, b in m.stored_by_type.items())

    def row(label: str, values: list[int], note: str = "", style: str | None = None) -> None:
        table.add_row(label, *(fmt_bytes(v) for v in values), note, style=style)

    n = len(first.contexts)
    row("weights (as stored)", [m.stored_bytes] * n, stored)
    windowed = _windowed(plan)
    row(
        "KV cache (pool)",
        [p.engine_kv_pool_bytes for p in first.contexts],
        f"{first.bytes_per_token:,} B/token"
        + (f"; sliding layers {windowed[-1].engine_pool.num_window_blocks} blocks each" if windowed else ""),
    )
    row(
        "activations",
        [p.activations.total for p in first.contexts],
        f"chunk {s.max_num_batched_tokens} tokens, {first.contexts[0].activations.attention_kernels} "
        f"attention",
    )
    row("runtime overhead", [plan.runtime_overhead] * n, "torch + Python + the tokenizer")
    row("total (plan)", [p.total for p in first.contexts], "weights as stored", style="bold")
    row(
        "total (engine)",
        [p.engine_total for p in first.contexts],
        f"weights {weight_format(plan.model, s)} {fmt_bytes(plan.engine_weight_bytes)}"
        + (" + a chunk of the GGUF in flight" if plan.model.mapped_bytes else "")
        + f", pool of {s.block_size}-token blocks",
    )
    console.print(table)

    fit = Table(
        "KV type",
        "bits/elem (K/V)",
        "bytes/token",
        *(f"KV @ {p.ctx:,}" for p in first.contexts),
        "largest ctx (plan)",
        "largest ctx (engine)",
        *(["disk tier (tokens)"] if s.disk_cache_bytes else []),
        box=box.SIMPLE_HEAD,
        title_justify="left",
        title=f"largest context that fits in {fmt_bytes(s.memory)} ({s.memory_source}), {seqs}",
    )
    for col in fit.columns[1:]:
        col.justify = "right"
    for t in plan.kv:
        bits = (
            fmt_bits(t.bits_per_element_k)
            if t.cache_type_k == t.cache_type_v
            else f"{fmt_bits(t.bits_per_element_k)}/{fmt_bits(t.bits_per_element_v)}"
        )
        fit.add_row(
            t.name,
            bits,
            f"{t.bytes_per_token:,}",
            *(fmt_bytes(p.engine_kv_pool_bytes) for p in t.contexts),
            _max_ctx(t.max_ctx, c.max_position_embeddings),
            _max_ctx(t.engine_max_ctx, c.max_position_embeddings),
            *([f"{t.disk_tier(s.disk_cache_bytes, s.block_size)[1]:,}"] if s.disk_cache_bytes else []),
        )
    console.print(fit)
    for line in notes(plan):
        console.print(f"[dim]· {line}[/dim]", highlight=False)
