"""Chained hashes of *full* KV blocks, the keys of the prefix cache.

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]       block_size = 16
    hashes:  h0 = H(root, t0..t15, salt)
             h1 = H(h0,   t16..t31, salt)              the partial tail block gets no hash

H is BLAKE2b (128 bits) under a 32-byte key: a block's hash commits to every token before it and
cannot be predicted or collided without the key (Python's ``hash`` of a tuple could be, whatever
its seed). The key is ``cache_key(secret, identity)``: the identity holds everything that makes K/V
differ for the same tokens (model file, weight format, KV types, block size, kernel path), so equal
hashes mean interchangeable blocks, and two processes with the same secret and identity agree on
every hash (the disk tier relies on it). Without a secret, each process draws its own.

The pool does not rely on the hash alone: a hit must also match the block's tokens, salt and the
very block computed before it (see ``block_pool``).

A block of the sliding-window layers (``kv.groups``) is cached under its full block's hash,
but a file of its own needs a name of its own: ``window_part_hash`` derives one from the full hash
under a personalization no chain hash uses, so the two never name the same file.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from collections.abc import Mapping

BlockHash = int

PROCESS_KEY: bytes = secrets.token_bytes(32)
_ROOT = bytes(16)
_MAX_TOKEN = 2**32


def cache_key(secret: bytes, identity: Mapping[str, object]) -> bytes:
    """The hashing key of one engine setup: ``identity`` (JSON-able) under ``secret``."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, key=secret, digest_size=32, person=b"kvserve-cachekey").digest()


def hash_block(
    parent: BlockHash | None, token_ids: tuple[int, ...], salt: str | None = None, key: bytes = PROCESS_KEY
) -> BlockHash:
    if any(not 0 <= t < _MAX_TOKEN for t in token_ids):
        raise ValueError(f"token ids must be in [0, 2^32): {token_ids}")
    h = hashlib.blake2b(key=key, digest_size=16)
    h.update(_ROOT if parent is None else parent.to_bytes(16, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if salt is not None:  # length-prefixed, so no salt is a prefix of another's encoding
        encoded = salt.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(encoded)) + encoded)
    return int.from_bytes(h.digest(), "little")


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: list[int],
    block_size: int,
    salt: str | None = None,
    key: bytes = PROCESS_KEY,
) -> None:
    """Append the hashes of blocks that became full since ``hashes`` was last extended."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), salt, key))


def window_part_hash(block_hash: BlockHash) -> BlockHash:
    """The name of the window group's part of the block ``block_hash`` names (its disk-tier file)."""
    h = hashlib.blake2b(block_hash.to_bytes(16, "little"), digest_size=16, person=b"kvserve-window")
    return int.from_bytes(h.digest(), "little")


def salt_digest(salt: str | None) -> str | None:
    """What a file records of a request's salt: enough to check it, not the salt itself."""
    if salt is None:
        return None
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
