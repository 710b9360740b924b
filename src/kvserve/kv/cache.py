"""An engine's KV cache as one typed object: the block accounting (``KVCacheManager``), the tensors
(``PagedKVStorage``), the identity its blocks were computed under, and the disk tier. What reads or writes
a cache's blocks outside the engine (prompt-cache files, ``kv/prompt_cache.py``) takes this, not the
engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import DiskOffload
from kvserve.kv.storage import PagedKVStorage


@dataclass(frozen=True, slots=True)
class KVCache:
    manager: KVCacheManager
    storage: PagedKVStorage
    # everything that makes the blocks' K/V what they are (computed once, on use)
    identity: Callable[[], dict]
    vocab_size: int  # token ids a cached prefix may hold
    offload: DiskOffload | None  # the disk tier, when on

    @property
    def prefix_caching(self) -> bool:
        return self.manager.enable_caching
