"""Prompt-cache files (``.kvc``): the K/V of a prompt's full blocks, saved by one process and loaded
by another, as llama.cpp's slot save/restore and mlx-lm's prompt caches do; a chat session's
messages may ride along.

The framing is ``file_framing``'s (magic KVSPC02), its digest keyed with this user's prompt-cache secret
(``CACHE_DIR/prompt-cache/secret``, made on first use, mode 0600): a file that labels one prompt's K/V
with another prompt's tokens cannot be made without the secret, so it cannot poison the prefix cache (or,
through it, the disk tier). To use a file on another machine, copy the secret with it. Every header field
is checked before use; a bad one is a one-line ``PromptCacheError``. Header: the engine identity it was
computed under, the tokens, the block count, and an optional ``extra`` object; payload: the blocks' bytes as
the pool stores them, one after another. With a window group (``kv.groups``) the header's
``window_blocks`` lists the blocks whose window parts (the sliding layers' bytes) follow, in that order, after
all the blocks: at least the window a query after the last block reads, so a prefix loaded whole is a hit
whole. A file without the key (any model without a window group) has no window parts.
A file is used only by an engine with the same identity (same model file, weight format, KV
types, block size and kernels); the error says which of these differ.

Loading puts the blocks in the pool as cached-free blocks (and in the disk tier when there is
one): a later request whose prompt starts with those tokens finds them like any cached prefix.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvserve.errors import KVServeError
from kvserve.kv.cache import KVCache
from kvserve.kv.disk_tier import BlockKey
from kvserve.kv.file_framing import KVFileError, pack, unpack, write_atomically
from kvserve.kv.hashing import window_part_hash

MAGIC = b"KVSPC02\n"
UNKEYED = b"KVSPC01\n"  # before files were keyed: refused


def _key() -> bytes:
    from kvserve.kv.disk_tier import load_secret
    from kvserve.native import cache_root

    root = cache_root() / "prompt-cache"
    root.mkdir(parents=True, exist_ok=True)
    return load_secret(root)


class PromptCacheError(KVServeError):
    """A prompt-cache file that cannot be used by this engine."""


def save_prompt_cache(cache: KVCache, token_ids: list[int], path: str | os.PathLike,
                      extra: dict | None = None) -> int:
    """Write the cached blocks of ``token_ids`` (as far as the pool or the disk tier hold them, and
    with a window group as far as their window parts make them a hit) to ``path``, atomically.
    Returns the number of tokens saved (whole blocks)."""
    blocks, parts = _cached_blocks(cache.manager, token_ids)
    if not blocks:
        window = " with the window parts a query after them reads" if cache.manager.tied else ""
        raise PromptCacheError(
            f"none of the {len(token_ids)} tokens' blocks are cached{window} (a prompt needs at least "
            f"{cache.manager.block_size} tokens, and prefix caching must be on)")
    data = cache.storage.export_blocks([b.block_id for b in blocks])
    num_tokens = len(blocks) * cache.manager.block_size
    header = {"identity": cache.identity(), "tokens": list(token_ids[:num_tokens]), "blocks": len(blocks),
              "extra": extra or {}}
    if parts:
        header["window_blocks"] = [i for i, _ in parts]
        storage = cache.storage
        window_data = storage.export_blocks([b.block_id for _, b in parts], storage.window_kv_group)
        data = np.concatenate([data.reshape(-1), window_data.reshape(-1)])
    write_atomically(Path(path), pack(MAGIC, header, memoryview(np.ascontiguousarray(data)).cast("B"),
                                      _key()))
    return num_tokens


def _cached_blocks(kv, token_ids: list[int]) -> tuple[list, list]:
    """The cached blocks of ``token_ids`` and (position, window block) of their cached window parts;
    with a window group, cut to the blocks a query after them could take whole (their last window's
    parts cached)."""
    blocks = kv.cached_prefix(token_ids)
    _, *window_parts = kv.cached_parts(token_ids, blocks)
    usable = kv.reusable_prefix(blocks, kv.lookup(token_ids))
    return blocks[:usable], [(i, b) for parts in window_parts for i, b in parts if i < usable]


class _FileBlocks:
    """A loaded file's blocks, as the source the manager installs from: the file holds a chain from its
    first block, so a key's position in the chain is its row; a window part's row is its position's
    place in ``window_blocks``. ``block_hashes``: the chain's hashes under the loading engine's key."""

    def __init__(self, storage, payload: memoryview, block_hashes: list[int],
                 window_blocks: list[int]) -> None:
        self.storage = storage
        data = np.frombuffer(payload, dtype=np.uint8)
        full_bytes = len(block_hashes) * storage.bytes_per_block
        self.rows = data[:full_bytes].reshape(len(block_hashes), -1)
        self.window_rows = data[full_bytes:].reshape(len(window_blocks), -1) if window_blocks else None
        self.window_row_of = {index: row for row, index in enumerate(window_blocks)}
        self.hashes = set(block_hashes) | {window_part_hash(block_hashes[i]) for i in window_blocks}

    def contains(self, block_hash: int) -> bool:
        return block_hash in self.hashes

    def load(self, block_ids: list[int], keys: list[BlockKey], kv_group: int = 0) -> int:
        if kv_group == 0:
            self.storage.import_blocks(block_ids, self.rows[[k.index for k in keys]])
            return len(block_ids)
        rows = []
        for key in keys:  # the parts the file has, up to the first it lacks
            if key.index not in self.window_row_of:
                break
            rows.append(self.window_row_of[key.index])
        if rows:
            self.storage.import_blocks(block_ids[: len(rows)], self.window_rows[rows], kv_group)
        return len(rows)


def read_prompt_cache(path: str | os.PathLike) -> tuple[dict, memoryview]:
    """(header, payload) of a file written under this user's key, its fields checked (``_check``)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PromptCacheError(f"cannot read the prompt cache {path}: {e.strerror or e}") from None
    if data[:8] == UNKEYED:
        raise PromptCacheError(f"{path} was saved by an older kvserve, without a key: save it again")
    try:
        header, payload = unpack(data, MAGIC, _key())
    except KVFileError as e:
        raise PromptCacheError(f"{path} is not a usable prompt cache (damaged, or saved under another "
                               f"user's or machine's secret): {e}") from None
    problem = _check(header)
    if problem:
        raise PromptCacheError(f"{path}: {problem}")
    return header, payload


def _check(header: dict) -> str | None:
    """What is wrong with a header's fields, or None."""
    tokens, blocks = header.get("tokens"), header.get("blocks")
    if not isinstance(header.get("identity"), dict):
        return "its header names no engine setup"
    if type(blocks) is not int or blocks < 1:
        return f"'blocks' must be a positive integer, got {blocks!r:.40}"
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        return "'tokens' must be a list of token ids"
    if not isinstance(header.get("extra", {}), dict):
        return "'extra' must be an object"
    if not isinstance(header.get("window_blocks", []), list):
        return "'window_blocks' must be a list"
    return None


def load_prompt_cache(cache: KVCache, path: str | os.PathLike) -> tuple[int, dict]:
    """Put the file's blocks into the engine's prefix cache. Returns (tokens now cached of the file's
    prefix, the file's ``extra``)."""
    header, payload = read_prompt_cache(path)
    identity, ours = header.get("identity"), cache.identity()
    if identity != ours:
        # only our own field names are printed: the file's keys are whatever its writer chose
        differs = [k for k in sorted(ours) if identity.get(k) != ours[k]]
        if any(k not in ours for k in identity):
            differs.append("fields this version does not know")
        raise PromptCacheError(
            f"{path} was saved by another engine setup (differs in: {', '.join(differs)}); "
                               f"load it with the same model file, --weights, KV types and block size")
    if not cache.prefix_caching:
        raise PromptCacheError("a prompt cache needs prefix caching (drop --no-prefix-caching)")
    tokens, num_blocks = header.get("tokens"), header.get("blocks")
    window_blocks = header.get("window_blocks", [])  # absent: a file without window parts
    bs = cache.manager.block_size
    if any(t >= cache.vocab_size for t in tokens):
        raise PromptCacheError(f"{path}: its tokens are not all of this model's vocabulary")
    if (len(tokens) != num_blocks * bs
            or not _valid_window_blocks(window_blocks, num_blocks, cache.storage)
            or len(payload) != _payload_bytes(cache.storage, num_blocks, window_blocks)):
        raise PromptCacheError(f"{path}: its header does not match its payload")
    blocks = _FileBlocks(cache.storage, payload, cache.manager.block_hashes_of(tokens), window_blocks)
    installed = cache.manager.install_prefix(tokens, blocks)
    if cache.offload is not None:
        cache.offload.save_prefix(cache.manager, tokens[: installed * bs])
    return installed * bs, header.get("extra") or {}


def _valid_window_blocks(window_blocks, num_blocks: int, storage) -> bool:
    """Block positions, ascending, each once, within the file's blocks, and only where the storage
    has a window group."""
    if not isinstance(window_blocks, list) or not all(type(i) is int for i in window_blocks):
        return False
    if window_blocks and not storage.windowed:
        return False
    return window_blocks == sorted(set(window_blocks)) and all(0 <= i < num_blocks for i in window_blocks)


def _payload_bytes(storage, num_blocks: int, window_blocks: list[int]) -> int:
    window = 0
    if window_blocks:
        window = len(window_blocks) * storage.kv_group_bytes_per_block(storage.window_kv_group)
    return num_blocks * storage.bytes_per_block + window
