"""Between the pool's tensors and the disk tier: blocks go out once computed, come back on a hit.

Every full block reaches the disk tier right after the step that computed it (write-through): the
step copies the new blocks' bytes out of the pool in one gather, the tier's thread writes them. A
block evicted from RAM later is then already on disk, and a crash loses at most the blocks still
queued. Loading reads and checks each file, then copies the blocks into the pool in one scatter.

With a window group (``kv.groups``) a block has two parts: the global layers' (group 0) and the
sliding layers' (group 1), each a file of its own (``KVGroup.part_key``). The engine saves right
after a step's forward, before the next allocation releases what fell out of the window, so every
block just computed still has its window part in the request's window table.
"""

from __future__ import annotations

import time

import numpy as np

from kvserve.kv.disk_tier import BlockKey, DiskTier
from kvserve.kv.hashing import salt_digest
from kvserve.kv.storage import PagedKVStorage


class DiskOffload:
    def __init__(self, storage: PagedKVStorage, tier: DiskTier) -> None:
        self.storage = storage
        self.tier = tier

    # --- the manager's LowerTier ----------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return self.tier.contains(block_hash)

    def touch(self, block_hashes: list[int], first_index: int = 0) -> None:
        self.tier.touch(block_hashes, first_index)

    def load(self, block_ids: list[int], keys: list[BlockKey], kv_group: int = 0) -> int:
        size = self.storage.kv_group_bytes_per_block(kv_group)
        payloads = []
        for key in keys:
            payload = self.tier.read(key, size)
            if payload is None:
                break
            payloads.append(payload)
        if payloads:
            data = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(payloads), size)
            self.storage.import_blocks(block_ids[: len(payloads)], data, kv_group)
        return len(payloads)

    # --- write-through --------------------------------------------------------------------------------
    def save_computed(self, kv, requests: list) -> None:
        """Queue every group's parts of the requests' blocks that are full, computed and cached since the
        last call (a block whose content the pool cached under another block is not written twice)."""
        wall_minus_perf = time.time() - time.perf_counter()
        saved = [([], []) for _ in kv.groups]
        for request in requests:
            salt = salt_digest(request.cache_salt)
            arrival = request.metrics.arrival_time + wall_minus_perf  # every block of a request: one time
            parts = kv.unsaved_parts(request)
            keys = {i: BlockKey.in_chain(request.block_hashes, i, block.token_ids, salt, arrival)
                    for i, block in parts[0]}  # the full group's: every position
            for group, group_parts, (blocks, group_keys) in zip(kv.groups, parts, saved, strict=True):
                blocks.extend(block for _, block in group_parts)
                group_keys.extend(group.part_key(keys[i]) for i, _ in group_parts)
        for group, (blocks, keys) in zip(kv.groups, saved, strict=True):
            self._save(blocks, keys, group.kv_group)

    def save_prefix(self, kv, token_ids: list[int]) -> None:
        """Queue the cached blocks of ``token_ids`` (unsalted), as far as the pool holds them, and the
        other groups' parts of them that their pools hold."""
        blocks = kv.cached_prefix(token_ids)
        hashes = [b.block_hash for b in blocks]  # a cached block holds its hash: the chain's, in order
        keys = [BlockKey.in_chain(hashes, i, b.token_ids, None) for i, b in enumerate(blocks)]
        for group, parts in zip(kv.groups, kv.cached_parts(token_ids, blocks), strict=True):
            self._save([b for _, b in parts], [group.part_key(keys[i]) for i, _ in parts], group.kv_group)

    def _save(self, blocks: list, keys: list[BlockKey], kv_group: int = 0) -> None:
        todo = [(b, k) for b, k in zip(blocks, keys, strict=True) if not self.tier.contains(k.block_hash)]
        if not todo:
            return
        data = self.storage.export_blocks([b.block_id for b, _ in todo], kv_group)
        for (_, key), row in zip(todo, data, strict=True):
            self.tier.put(key, memoryview(row), owner=data)
