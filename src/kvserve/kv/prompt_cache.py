"""Prompt-cache files (``.kvc``): the K/V of a prompt's full blocks, saved by one process and loaded
by another, as llama.cpp's slot save/restore and mlx-lm's prompt caches do; a chat session's
messages may ride along.

The framing is ``kv_file``'s (magic KVSPC01, an unkeyed checksum, so a file can move to another
machine). Header: the engine identity it was computed under, the tokens, the block count, and an
optional ``extra`` object; payload: the blocks' bytes as the pool stores them, one after another.
A file is used only by an engine with the same identity (same model file, weight format, KV
types, block size and kernels); the error says which of these differ.

Loading puts the blocks in the pool as cached-free blocks (and in the disk tier when there is
one): a later request whose prompt starts with those tokens finds them like any cached prefix.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvserve.errors import KVServeError
from kvserve.kv.disk_tier import BlockKey
from kvserve.kv.kv_file import KVFileError, pack, unpack, write_atomically

MAGIC = b"KVSPC01\n"


class PromptCacheError(KVServeError):
    """A prompt-cache file that cannot be used by this engine."""


def save_prompt_cache(engine, token_ids: list[int], path: str | os.PathLike, extra: dict | None = None) -> int:
    """Write the cached blocks of ``token_ids`` (as far as the pool or the disk tier hold them) to
    ``path``, atomically. Returns the number of tokens saved (whole blocks)."""
    blocks = engine.kv.cached_prefix(token_ids)
    if not blocks:
        raise PromptCacheError(
            f"none of the {len(token_ids)} tokens' blocks are cached (a prompt needs at least "
            f"{engine.kv.block_size} tokens, and prefix caching must be on)")
    data = engine.storage.export_blocks([b.block_id for b in blocks])
    num_tokens = len(blocks) * engine.kv.block_size
    header = {"identity": engine.cache_identity, "tokens": list(token_ids[:num_tokens]), "blocks": len(blocks),
              "extra": extra or {}}
    write_atomically(Path(path), pack(MAGIC, header, memoryview(data.numpy()).cast("B")))
    return num_tokens


class _FileBlocks:
    """A loaded file's blocks, as the source the manager installs from: the file holds a chain from its
    first block, so a key's position in the chain is its row."""

    def __init__(self, storage, payload: memoryview, num_blocks: int) -> None:
        self.storage = storage
        self.rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(num_blocks, -1)

    def load(self, block_ids: list[int], keys: list[BlockKey]) -> int:
        self.storage.import_blocks(block_ids, self.rows[[k.index for k in keys]])
        return len(block_ids)


def read_prompt_cache(path: str | os.PathLike) -> tuple[dict, memoryview]:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PromptCacheError(f"cannot read the prompt cache {path}: {e.strerror or e}") from None
    try:
        return unpack(data, MAGIC)
    except KVFileError as e:
        raise PromptCacheError(f"{path} is not a usable prompt cache: {e}") from None


def load_prompt_cache(engine, path: str | os.PathLike) -> tuple[int, dict]:
    """Put the file's blocks into the engine's prefix cache. Returns (tokens now cached of the file's
    prefix, the file's ``extra``)."""
    header, payload = read_prompt_cache(path)
    identity = header.get("identity")
    if identity != engine.cache_identity:
        differs = sorted(k for k in {**engine.cache_identity, **(identity or {})}
                         if (identity or {}).get(k) != engine.cache_identity.get(k))
        raise PromptCacheError(f"{path} was saved by another engine setup (differs in: {', '.join(differs)}); "
                               f"load it with the same model file, --weights, KV types and block size")
    if not engine.config.cache.enable_prefix_caching:
        raise PromptCacheError("a prompt cache needs prefix caching (drop --no-prefix-caching)")
    tokens, num_blocks = header.get("tokens"), header.get("blocks")
    bs = engine.kv.block_size
    if (not isinstance(tokens, list) or not isinstance(num_blocks, int) or len(tokens) != num_blocks * bs
            or len(payload) != num_blocks * engine.storage.bytes_per_block):
        raise PromptCacheError(f"{path}: its header does not match its payload")
    installed = engine.kv.install_prefix(tokens, _FileBlocks(engine.storage, payload, num_blocks))
    if engine.offload is not None:
        engine.offload.save_prefix(engine.kv, tokens[: installed * bs])
    return installed * bs, header.get("extra") or {}
