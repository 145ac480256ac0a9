"""Where the plugin touches vLLM (docs/research/vllm-retention-plugin.md has the line numbers).

Three patch points, the same in vLLM 0.32.0 and 0.33.0:

* ``vllm.v1.core.block_pool.FreeKVCacheBlockQueue`` (looked up when a ``BlockPool`` is built,
  after the plugins load in the engine core process): the retention queue;
* ``BlockPool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
  ...)``: the one place that sees a request and the blocks it caches — each new full block
  ``i`` (tokens ``[i * block_size, (i + 1) * block_size)``) is claimed at
  ``block_retention(lo, hi, prompt_len)``;
* ``KVCacheManager.allocate_slots(request, num_new_tokens, num_new_computed_tokens,
  new_computed_blocks, ...)``: the one place that sees a request and the cached blocks it
  reuses (prefix hits never pass through ``cache_full_blocks``).

Freeing needs no hook: the queue reads a block's claim when vLLM frees it.
"""

from __future__ import annotations

import functools
from typing import Any

from kvflow_vllm.queue import make_queue_class
from kvflow_vllm.retention import retention_of


def _queue_of(block: Any) -> Any:
    pool = getattr(block, "pool", None)
    queue = getattr(pool, "free_block_queue", None)
    return queue if getattr(queue, "kvflow_retention", False) else None


def claim_blocks(request: Any, blocks: Any, first: int, end: int, block_size: int) -> None:
    """``request``'s retention claims ``blocks[first:end]`` (block ``i`` holds tokens
    ``[i * block_size, (i + 1) * block_size)`` of the request)."""
    cfg = retention_of(request)
    if cfg is None:
        return
    prompt_len = request.num_prompt_tokens
    for i in range(first, end):
        block = blocks[i]
        if getattr(block, "is_null", False):
            continue
        queue = _queue_of(block)
        if queue is not None:
            queue.claim(block, *cfg.block_retention(i * block_size, (i + 1) * block_size, prompt_len))


#: The name ``BlockPool.__init__`` looks the queue class up by, in ``vllm.v1.core.block_pool``.
QUEUE = "FreeKVCacheBlockQueue"
_originals: dict[str, Any] = {}


def unpatch() -> None:
    """vLLM as it was before :func:`patch` (tests)."""
    import vllm.v1.core.block_pool as block_pool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if _originals:
        setattr(block_pool, QUEUE, _originals.pop("queue"))
        block_pool.BlockPool.cache_full_blocks = _originals.pop("cache_full_blocks")  # type: ignore[method-assign]
        KVCacheManager.allocate_slots = _originals.pop("allocate_slots")  # type: ignore[method-assign]


def patch() -> None:
    """Install the queue and the two hooks (once)."""
    import vllm.v1.core.block_pool as block_pool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if _originals:
        return
    cache_full_blocks = block_pool.BlockPool.cache_full_blocks
    allocate_slots = KVCacheManager.allocate_slots
    stock_queue = getattr(block_pool, QUEUE)
    _originals.update(queue=stock_queue, cache_full_blocks=cache_full_blocks, allocate_slots=allocate_slots)
    setattr(block_pool, QUEUE, make_queue_class(stock_queue))

    @functools.wraps(cache_full_blocks)
    def cache_full_blocks_retained(self: Any, request: Any, blocks: Any, num_cached_blocks: int,
                                   num_full_blocks: int, block_size: int, *args: Any, **kwargs: Any) -> Any:
        out = cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                *args, **kwargs)
        claim_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size)
        return out

    @functools.wraps(allocate_slots)
    def allocate_slots_retained(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        hits = kwargs.get("new_computed_blocks", args[2] if len(args) > 2 else None)
        out = allocate_slots(self, request, *args, **kwargs)
        if out is not None and hits is not None:
            for group, blocks in enumerate(hits.blocks):
                size = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
                claim_blocks(request, blocks, 0, len(blocks), size)
        return out

    block_pool.BlockPool.cache_full_blocks = cache_full_blocks_retained  # type: ignore[method-assign]
    KVCacheManager.allocate_slots = allocate_slots_retained  # type: ignore[method-assign]
