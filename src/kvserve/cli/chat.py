"""The interactive chat of ``kvserve run`` (like ``ollama run``): /bye, /clear, /set, /show, /save, /load."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.engine.sampling_params import SamplingParams

HELP = """commands:
  /bye                      leave
  /clear                    forget the conversation
  /set parameter NAME VALUE temperature, top_p, top_k, min_p, seed, max_tokens, repetition_penalty
  /set system TEXT          replace the system message
  /show cache               KV pool: blocks in use, cached, free
  /save NAME                save the conversation and its KV cache (NAME or a path ending in .kvc)
  /load NAME                go on with a saved conversation, its prompt already cached
  /?                        this help"""

_PARAMETERS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
               "max_tokens": int, "repetition_penalty": float, "num_predict": int, "repeat_penalty": float}
_ALIASES = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}


@dataclass(slots=True)
class ChatSession:
    params: SamplingParams
    system: str | None = None
    history: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the last turn's prompt and answer: what the cache holds

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history


def sessions_dir() -> Path:
    from kvserve.kv.disk_tier import default_cache_dir

    return default_cache_dir().parent / "sessions"


def session_path(name: str) -> Path:
    """A bare name lives in the sessions folder; anything that looks like a path is used as given."""
    if "/" in name or name.endswith(".kvc"):
        return Path(name).expanduser()
    return sessions_dir() / f"{name}.kvc"


def interactive_chat(engine, params: SamplingParams, system: str | None) -> int:
    from kvserve.cli.live import generate_streaming, stats_line

    chat = ChatSession(params, system)
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
            if not _command(text, engine, chat):
                return 0
            continue
        messages = chat.messages() + [{"role": "user", "content": line}]
        prompt_ids = engine.tokenizer.encode_chat(messages)
        final = generate_streaming(engine, prompt_ids, chat.params)
        print()
        print(stats_line(engine, final), file=sys.stderr)
        chat.history = messages[1:] if chat.system else messages
        chat.history.append({"role": "assistant", "content": final.text})
        chat.tokens = list(final.prompt_token_ids) + list(final.token_ids)


def _command(text: str, engine, chat: ChatSession) -> bool:
    """Run one slash command on ``chat``; False when the chat should end."""
    parts = text.split(maxsplit=3)
    cmd = parts[0]
    if cmd in ("/bye", "/exit", "/quit"):
        return False
    if cmd == "/clear":
        chat.history, chat.tokens = [], []
        print("conversation cleared", file=sys.stderr)
    elif cmd == "/set" and len(parts) >= 3 and parts[1] == "system":
        chat.system = text.split(maxsplit=2)[2]
    elif cmd == "/set" and len(parts) == 4 and parts[1] == "parameter":
        name, value = parts[2], parts[3]
        if name not in _PARAMETERS:
            print(f"unknown parameter {name!r}; known: {', '.join(_PARAMETERS)}", file=sys.stderr)
            return True
        try:
            chat.params = dataclasses.replace(chat.params,
                                              **{_ALIASES.get(name, name): _PARAMETERS[name](value)})
            print(f"set {name} = {value}", file=sys.stderr)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
    elif cmd == "/show" and len(parts) >= 2 and parts[1] == "cache":
        print(cache_report(engine), file=sys.stderr)
    elif cmd in ("/save", "/load") and len(parts) == 2:
        _save_or_load(cmd, session_path(parts[1]), engine, chat)
    else:
        print(HELP, file=sys.stderr)
    return True


def _save_or_load(cmd: str, path: Path, engine, chat: ChatSession) -> None:
    from kvserve.errors import KVServeError
    from kvserve.kv.prompt_cache import load_prompt_cache, save_prompt_cache

    try:
        if cmd == "/save":
            if not chat.history:
                print("nothing to save yet: say something first", file=sys.stderr)
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            extra = {"system": chat.system, "history": chat.history}
            tokens = save_prompt_cache(engine.cache, chat.tokens, path, extra)
            print(f"saved the conversation ({len(chat.history)} messages, {tokens} tokens of KV) to {path}",
                  file=sys.stderr)
            return
        tokens, extra = load_prompt_cache(engine.cache, path)
        history = extra.get("history")
        if not isinstance(history, list):
            print(f"{path} holds a prompt cache but no conversation; {tokens} tokens cached", file=sys.stderr)
            return
        chat.system, chat.history, chat.tokens = extra.get("system"), history, []
        print(f"loaded {len(history)} messages from {path} ({tokens} tokens cached)", file=sys.stderr)
    except (KVServeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)


def cache_report(engine) -> str:
    """The KV pool as blocks (in use, shared, cached-free, free) and bytes by K and V type."""
    pool = engine.kv.snapshot(blocks=True).full
    cache = engine.config.cache
    in_use = sum(1 for state in pool.block_states if state > 0)
    shared = sum(1 for state in pool.block_states if state > 1)
    cached_free = pool.block_states.count(-1)
    free = pool.num_free - cached_free
    cfg = engine.model_config
    per_vector_tokens = cfg.num_layers * cfg.num_kv_heads * cache.block_size  # head-vectors per block, K or V
    k_block = per_vector_tokens * engine.storage.k_codec.bytes_per_vector()
    v_block = per_vector_tokens * engine.storage.v_codec.bytes_per_vector()
    mib = 2**20
    return (
        f"KV pool: {pool.num_blocks} blocks of {cache.block_size} tokens, {engine.kv_pool_bytes / mib:.1f} "
        f"MiB\n"
        f"  blocks: in use {in_use} (shared {shared}), cached-free {cached_free}, free {free}\n"
        f"  K {cache.cache_type_k}: {in_use * k_block / mib:.2f} MiB in use of "
        f"{pool.num_blocks * k_block / mib:.1f} MiB\n"
        f"  V {cache.cache_type_v_resolved}: {in_use * v_block / mib:.2f} MiB in use of "
        f"{pool.num_blocks * v_block / mib:.1f} MiB"
    )
