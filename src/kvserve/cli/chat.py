"""The interactive chat of ``kvserve run`` (like ``ollama run``): /bye, /clear, /set, /show."""

from __future__ import annotations

import dataclasses
import sys

from kvserve.engine.sampling_params import SamplingParams

HELP = """commands:
  /bye                      leave
  /clear                    forget the conversation
  /set parameter NAME VALUE temperature, top_p, top_k, min_p, seed, max_tokens, repetition_penalty
  /set system TEXT          replace the system message
  /show cache               KV pool: blocks in use, cached, free
  /?                        this help"""

_PARAMETERS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
               "max_tokens": int, "repetition_penalty": float, "num_predict": int, "repeat_penalty": float}
_ALIASES = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}


def interactive_chat(engine, params: SamplingParams, system: str | None) -> int:
    from kvserve.cli.run import generate_streaming, stats_line

    history: list[dict] = []
    print("chat with the model; /? for help, /bye to leave", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            result = _command(text, engine, params, system, history)
            if result is None:
                return 0
            params, system, history = result
            continue
        messages = ([{"role": "system", "content": system}] if system else []) + history
        messages.append({"role": "user", "content": line})
        final = generate_streaming(engine, engine.tokenizer.encode_chat(messages), params)
        print()
        print(stats_line(engine, final), file=sys.stderr)
        history = messages[1:] if system else messages
        history.append({"role": "assistant", "content": final.text})


def _command(text, engine, params, system, history):
    parts = text.split(maxsplit=3)
    cmd = parts[0]
    if cmd in ("/bye", "/exit", "/quit"):
        return None
    if cmd == "/clear":
        print("conversation cleared", file=sys.stderr)
        return params, system, []
    if cmd == "/set" and len(parts) >= 3 and parts[1] == "system":
        return params, text.split(maxsplit=2)[2], history
    if cmd == "/set" and len(parts) == 4 and parts[1] == "parameter":
        name, value = parts[2], parts[3]
        if name not in _PARAMETERS:
            print(f"unknown parameter {name!r}; known: {', '.join(_PARAMETERS)}", file=sys.stderr)
            return params, system, history
        try:
            params = dataclasses.replace(params, **{_ALIASES.get(name, name): _PARAMETERS[name](value)})
            print(f"set {name} = {value}", file=sys.stderr)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
        return params, system, history
    if cmd == "/show" and len(parts) >= 2 and parts[1] == "cache":
        print(cache_report(engine), file=sys.stderr)
        return params, system, history
    print(HELP, file=sys.stderr)
    return params, system, history


def cache_report(engine) -> str:
    """The KV pool as blocks (in use, shared, cached-free, free) and bytes by K and V type."""
    pool = engine.kv.pool
    cache = engine.config.cache
    in_use = sum(1 for b in pool.blocks if b.ref_count > 0)
    shared = sum(1 for b in pool.blocks if b.ref_count > 1)
    cached_free = pool.num_cached_free_blocks
    free = pool.num_free_blocks - cached_free
    cfg = engine.model_config
    per_vector_tokens = cfg.num_layers * cfg.num_kv_heads * cache.block_size  # head-vectors per block, K or V
    k_block = per_vector_tokens * engine.storage.k_codec.bytes_per_vector()
    v_block = per_vector_tokens * engine.storage.v_codec.bytes_per_vector()
    mib = 2**20
    return (
        f"KV pool: {pool.num_blocks} blocks of {cache.block_size} tokens, {engine.kv_pool_bytes / mib:.1f} MiB\n"
        f"  blocks: in use {in_use} (shared {shared}), cached-free {cached_free}, free {free}\n"
        f"  K {cache.cache_type_k}: {in_use * k_block / mib:.2f} MiB in use of {pool.num_blocks * k_block / mib:.1f} MiB\n"
        f"  V {cache.cache_type_v_resolved}: {in_use * v_block / mib:.2f} MiB in use of "
        f"{pool.num_blocks * v_block / mib:.1f} MiB"
    )
