"""Between the pool's tensors and the disk tier: blocks go out once computed, come back on a hit.

Every full block reaches the disk tier right after the step that computed it (write-through): the
step copies the new blocks' bytes out of the pool in one gather, the tier's thread writes them. A
block evicted from RAM later is then already on disk, and a crash loses at most the blocks still
queued. Loading reads and checks each file, then copies the blocks into the pool in one scatter.

With a window group (``kv.window_blocks``) a block has two parts: the global layers' (group 0) and
the sliding layers' (group 1), each a file of its own (see ``BlockKey.window_part``). The engine
saves right after a step's forward, before the next allocation releases what fell out of the window,
so every block just computed still has its window part in the request's window table.
"""

from __future__ import annotations

import time

import torch

from kvserve.kv.disk_tier import BlockKey, DiskTier
from kvserve.kv.hashing import salt_digest
from kvserve.kv.storage import PagedKVStorage
from kvserve.kv.window_blocks import WINDOW_KV_GROUP


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
            data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(
                len(payloads), size)
            self.storage.import_blocks(block_ids[: len(payloads)], data, kv_group)
        return len(payloads)

    # --- write-through --------------------------------------------------------------------------------
    def save_computed(self, kv, requests: list) -> None:
        """Queue the requests' blocks that are full, computed and cached since the last call (a block
        whose content the pool cached under another block is not written twice), with their window
        parts."""
        wall_minus_perf = time.time() - time.perf_counter()
        blocks, keys, window_blocks, window_keys = [], [], [], []
        for request in requests:
            hashes = request.block_hashes
            salt = salt_digest(request.cache_salt)
            arrival = request.metrics.arrival_time + wall_minus_perf  # every block of a request: one time
            for i, block in kv.unsaved_blocks(request):
                blocks.append(block)
                keys.append(BlockKey.in_chain(hashes, i, block.token_ids, salt, arrival))
                window_block = kv.window_block(request.request_id, i)
                if window_block is not None:
                    window_blocks.append(window_block)
                    window_keys.append(keys[-1].window_part())
        self._save(blocks, keys)
        self._save(window_blocks, window_keys, WINDOW_KV_GROUP)

    def save_prefix(self, kv, token_ids: list[int]) -> None:
        """Queue the cached blocks of ``token_ids`` (unsalted), as far as the pool holds them, and the
        window parts the window pool holds of them."""
        blocks = kv.cached_prefix(token_ids)
        hashes = [b.block_hash for b in blocks]  # a cached block holds its hash: the chain's, in order
        keys = [BlockKey.in_chain(hashes, i, b.token_ids, None) for i, b in enumerate(blocks)]
        parts = kv.cached_window_parts(token_ids, blocks)
        self._save(blocks, keys)
        self._save([b for _, b in parts], [keys[i].window_part() for i, _ in parts], WINDOW_KV_GROUP)

    def _save(self, blocks: list, keys: list[BlockKey], kv_group: int = 0) -> None:
        todo = [(b, k) for b, k in zip(blocks, keys, strict=True) if not self.tier.contains(k.block_hash)]
        if not todo:
            return
        data = self.storage.export_blocks([b.block_id for b, _ in todo], kv_group)
        for (_, key), row in zip(todo, data.numpy(), strict=True):
            self.tier.put(key, memoryview(row), owner=data)
