"""Where the plugin touches vLLM (docs/research/vllm-retention-plugin.md has the line numbers).

Four patch points, the same in vLLM 0.32.0 and 0.33.0:

* ``vllm.v1.core.block_pool.FreeKVCacheBlockQueue`` (looked up when a ``BlockPool`` is built,
  after the plugins load in the engine core process): the retention queue;
* ``BlockPool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
  ...)``: the one place that sees a request and the blocks it caches — each new full block
  ``i`` (tokens ``[i * block_size, (i + 1) * block_size)``) is claimed at
  ``block_retention(lo, hi, prompt_len)``;
* ``KVCacheManager.allocate_slots(request, num_new_tokens, num_new_computed_tokens,
  new_computed_blocks, ...)``: the one place that sees a request and the cached blocks it
  reuses (prefix hits never pass through ``cache_full_blocks``).

and ``vllm.v1.core.block_pool.BlockStored``, the stored-block event: a subclass with the blocks'
``priorities`` (every stored event, so a bridge sees the plugin) and ``priority_update`` (vLLM's own
decoder ignores both; kvflow's bridge reads them). A request that raises the priority of blocks it
reuses re-reports them (vLLM's ``emit_cached_block_events``) with ``priority_update``.

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


def claim_blocks(request: Any, blocks: Any, first: int, end: int, block_size: int) -> tuple[list[int], bool]:
    """``request``'s retention claims ``blocks[first:end]`` (block ``i`` holds tokens
    ``[i * block_size, (i + 1) * block_size)`` of the request); the blocks' priorities after it, in
    order (35 for those it leaves alone; [] where the pool has no retention queue), and whether a
    priority changed."""
    cfg = retention_of(request)
    prompt_len = request.num_prompt_tokens
    out = []
    changed = False
    for i in range(first, end):
        block = blocks[i]
        if getattr(block, "is_null", False):
            continue
        queue = _queue_of(block)
        if queue is None:
            return [], False
        if cfg is not None:
            before = queue.retention(block)
            queue.claim(block, *cfg.block_retention(i * block_size, (i + 1) * block_size, prompt_len))
            changed = changed or queue.retention(block) != before
        out.append(queue.retention(block)[0])
    return out, changed


def stored_event_class(base: type) -> type:
    """vLLM's ``BlockStored`` with each block's priority (``priorities``) and ``priority_update``
    (True: blocks already stored, re-reported because a request raised their priority): the same
    tag and trailing fields, so vLLM's own decoder reads it as a plain ``BlockStored`` (an update is
    then a re-report, as vLLM's own ``kv_cache_report_mode: "full"`` sends)."""

    class BlockStoredRetained(base, tag="BlockStored"):  # type: ignore[misc,call-arg]
        priorities: list[int] | None = None
        priority_update: bool = False

    return BlockStoredRetained


def _carry(stored: Any, priorities: list[int], update: bool = False) -> bool:
    """Put ``priorities`` on a ``BlockStored`` of as many blocks (ours: it has the fields)."""
    if not hasattr(stored, "priorities") or len(stored.block_hashes) != len(priorities):
        return False
    stored.priorities = priorities
    stored.priority_update = update
    return True


def publish_update(pool: Any, request: Any, priorities: list[int], block_size: int, group: int) -> None:
    """``request`` raised the priority of cached blocks it reuses (its prefix hit, ``priorities``
    in order from the first block): re-report them with vLLM's own ``emit_cached_block_events``,
    marked ``priority_update`` (kvflow's bridge turns it into ``updated`` events)."""
    events = getattr(pool, "kv_event_queue", None)
    if not getattr(pool, "enable_kv_cache_events", False) or events is None:
        return
    before = len(events)
    pool.emit_cached_block_events(request, len(priorities), block_size, group)
    if len(events) > before and not _carry(events[-1], priorities, update=True):
        del events[before:]  # not an event of ours to mark: sending it would read as copies


#: The name ``BlockPool.__init__`` looks the queue class up by, in ``vllm.v1.core.block_pool``.
QUEUE = "FreeKVCacheBlockQueue"
#: The name its events are built by there (``BlockStored``).
EVENT = "BlockStored"
_originals: dict[str, Any] = {}


def unpatch() -> None:
    """vLLM as it was before :func:`patch` (tests)."""
    import vllm.v1.core.block_pool as block_pool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if _originals:
        setattr(block_pool, QUEUE, _originals.pop("queue"))
        setattr(block_pool, EVENT, _originals.pop("event"))
        block_pool.BlockPool.cache_full_blocks = _originals.pop("cache_full_blocks")  # type: ignore[method-assign,unused-ignore]
        KVCacheManager.allocate_slots = _originals.pop("allocate_slots")  # type: ignore[method-assign,unused-ignore]


def patch() -> None:
    """Install the queue and the two hooks (once)."""
    import vllm.v1.core.block_pool as block_pool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if _originals:
        return
    cache_full_blocks = block_pool.BlockPool.cache_full_blocks
    allocate_slots = KVCacheManager.allocate_slots
    stock_queue = getattr(block_pool, QUEUE)
    stock_event = getattr(block_pool, EVENT)
    _originals.update(queue=stock_queue, event=stock_event, cache_full_blocks=cache_full_blocks,
                      allocate_slots=allocate_slots)
    setattr(block_pool, QUEUE, make_queue_class(stock_queue))
    setattr(block_pool, EVENT, stored_event_class(stock_event))

    @functools.wraps(cache_full_blocks)
    def cache_full_blocks_retained(self: Any, request: Any, blocks: Any, num_cached_blocks: int,
                                   num_full_blocks: int, block_size: int, *args: Any, **kwargs: Any) -> Any:
        events = getattr(self, "kv_event_queue", None)
        before = len(events) if events is not None else 0
        out = cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                *args, **kwargs)
        priorities, _ = claim_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size)
        if priorities and events is not None and len(events) > before:
            _carry(events[-1], priorities)  # the one BlockStored of these blocks (vLLM appends it last)
        return out

    @functools.wraps(allocate_slots)
    def allocate_slots_retained(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        hits = kwargs.get("new_computed_blocks", args[2] if len(args) > 2 else None)
        out = allocate_slots(self, request, *args, **kwargs)
        if out is not None and hits is not None and retention_of(request) is not None:  # none: nothing to claim
            for group, blocks in enumerate(hits.blocks):
                size = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
                priorities, changed = claim_blocks(request, blocks, 0, len(blocks), size)
                if changed and len(priorities) == len(blocks):  # a prefix of real blocks (no skipped null ones)
                    publish_update(self.block_pool, request, priorities, size, group)
        return out

    block_pool.BlockPool.cache_full_blocks = cache_full_blocks_retained  # type: ignore[method-assign,unused-ignore]
    KVCacheManager.allocate_slots = allocate_slots_retained  # type: ignore[method-assign,unused-ignore]
