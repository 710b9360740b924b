"""Chained hashes of *full* KV blocks, the keys of the prefix cache.

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]       block_size = 16
    hashes:  h0 = H(seed, t0..t15, salt)
             h1 = H(h0,   t16..t31, salt)              the partial tail block gets no hash

A block's hash covers every token before it, so equal hashes mean equal prefixes. Hashes are
64-bit and may collide; the pool keeps each cached block's token ids and verifies them on a hit.
The seed is drawn once per process so hashes cannot be predicted from outside.
"""

from __future__ import annotations

import secrets

BlockHash = int

PROCESS_SEED: int = secrets.randbits(63)


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...], salt: str | None = None) -> BlockHash:
    return hash((PROCESS_SEED if parent is None else parent, token_ids, salt))


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: list[int], block_size: int, salt: str | None = None
) -> None:
    """Append the hashes of blocks that became full since ``hashes`` was last extended."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), salt))
