"""How many blocks the engine's paged pool holds, and its bytes: plain integers, no torch, so that
``kvserve plan`` sizes the pool with the engine's own arithmetic.

Without a window group every layer has ``num_blocks`` blocks. With one (``window_group_layers``), the
sliding-window layers have ``num_window_blocks`` blocks of their own (``kv.groups``) and the
other layers ``num_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import CacheConfig, ModelConfig
from kvserve.kv.cache_types import kv_bytes_per_token_per_layer, pool_num_blocks
from kvserve.kv.groups import window_pool_blocks


@dataclass(frozen=True, slots=True)
class PoolSize:
    num_blocks: int
    max_model_len: int  # tokens one request may hold (prompt + output)
    window_layers: frozenset[int] = frozenset()  # layers whose blocks are the window group's
    num_window_blocks: int = 0


def window_group_layers(model: ModelConfig, cache: CacheConfig) -> frozenset[int]:
    """The sliding-window layers, where they can keep only their window (``kv.groups``): a
    model with both kinds of layer (the window group's blocks are tied to the global layers')."""
    if not cache.window_kv or not model.sliding_window:
        return frozenset()
    sliding = frozenset(i for i in range(model.num_layers) if model.is_sliding(i))
    return sliding if len(sliding) < model.num_layers else frozenset()


def pool_size(model: ModelConfig, cache: CacheConfig, max_num_seqs: int,
              max_num_batched_tokens: int = 512) -> PoolSize:
    """Blocks in the pool: ``kv_cache_memory`` bytes when given, else room for ``max_num_seqs``
    sequences of ``num_ctx`` tokens each. Sliding-window layers get a pool of their own sized for their
    windows (``window_pool_blocks``) where that is smaller than keeping every token."""
    bs = cache.block_size
    if cache.num_ctx < 1:
        raise ValueError(f"num_ctx must be >= 1, got {cache.num_ctx}")
    layer_block = bs * kv_bytes_per_token_per_layer(model, cache.cache_type_k, cache.cache_type_v)
    window = window_group_layers(model, cache)
    num_window = window_pool_blocks(model.sliding_window, bs, max_num_seqs,
                                    max_num_batched_tokens) if window else 0
    if cache.kv_cache_memory is not None:
        per_block = model.num_layers * layer_block
        num_blocks = cache.kv_cache_memory // per_block
        if window:  # when the window pool leaves the global layers more context than every layer every token
            full = (cache.kv_cache_memory - num_window * len(window) * layer_block) // (
                (model.num_layers - len(window)) * layer_block)
            if full > num_blocks:
                return PoolSize(full, min(cache.num_ctx, full * bs), window, num_window)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {cache.kv_cache_memory} bytes holds no block of {per_block} bytes "
                f"({bs} tokens); give at least {per_block}"
            )
        return PoolSize(num_blocks, min(cache.num_ctx, num_blocks * bs))
    num_blocks = pool_num_blocks(cache.num_ctx, max_num_seqs, bs)
    if window and num_window < num_blocks:
        return PoolSize(num_blocks, cache.num_ctx, window, num_window)
    return PoolSize(num_blocks, cache.num_ctx)


def pool_nbytes(model: ModelConfig, cache: CacheConfig, size: PoolSize) -> int:
    """Bytes of the pool ``size`` (what ``PagedKVStorage.nbytes`` allocates for it): each layer's blocks
    times one block of one layer."""
    per_token = kv_bytes_per_token_per_layer(model, cache.cache_type_k, cache.cache_type_v)
    layer_block = cache.block_size * per_token
    num_window_layers = len(size.window_layers)
    blocks = (
        model.num_layers - num_window_layers
    ) * size.num_blocks + num_window_layers * size.num_window_blocks
    return blocks * layer_block


def context_pool(
    model: ModelConfig, num_ctx: int, max_num_seqs: int, block_size: int, cache_type_k: str,
    cache_type_v: str | None = None, max_num_batched_tokens: int = 512, window_kv: bool = True,
) -> tuple[PoolSize, int]:
    """The pool the engine allocates for ``max_num_seqs`` x ``num_ctx`` tokens, and its bytes."""
    cache = CacheConfig(block_size=block_size, num_ctx=num_ctx, cache_type_k=cache_type_k,
                        cache_type_v=cache_type_v, window_kv=window_kv)
    size = pool_size(model, cache, max_num_seqs, max_num_batched_tokens)
    return size, pool_nbytes(model, cache, size)


def context_pool_bytes(
    model: ModelConfig, num_ctx: int, max_num_seqs: int, block_size: int, cache_type_k: str,
    cache_type_v: str | None = None, max_num_batched_tokens: int = 512, window_kv: bool = True,
) -> int:
    """Bytes of the pool the engine allocates for ``max_num_seqs`` x ``num_ctx`` tokens
    (``context_pool``'s)."""
    return context_pool(model, num_ctx, max_num_seqs, block_size, cache_type_k, cache_type_v,
                        max_num_batched_tokens, window_kv)[1]
