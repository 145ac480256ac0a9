"""vLLM's free-block queue with kvflow's retention order (docs/vllm-retention.md).

vLLM's ``BlockPool`` evicts from the front of its ``FreeKVCacheBlockQueue``: blocks that hold no
cached KV (``prepend_n``, and every block at the start) come first, then the cached ones in the
order they were freed (``append_n``): LRU. :class:`RetentionFreeQueue` keeps the first part as vLLM
does (its own linked list, vLLM's code) and orders the second part with kvflow's
:class:`~inference_node.kv.policy.PriorityRetention` — the very order kvflow's own node runs:
lowest priority first, least recently freed first within a priority; a retention duration that
runs out drops its block to the default priority (35). Each vLLM block has a kvflow
:class:`~inference_node.kv.block.Block` record (vLLM's blocks take no new attributes) with no
parent and no children, so the leaf rule never holds one back.

**Without retention nothing changes**: every cached block is at 35, so the order is the order of
``append_n``, exactly vLLM's list (``tests/kvflow_vllm/test_queue.py`` replays request streams
through vLLM's real ``KVCacheManager`` with and without the queue and compares every free-block
order).

**Claims.** A request's retention claims the blocks it caches or reuses (:meth:`claim`, called by
the plugin's hooks). The first claim on a cached block sets its priority and duration; a later one
replaces it only with a higher priority (or the same priority for longer): a block shared by
requests keeps the highest claim. A request without retention claims nothing (the block keeps
what it has). A block that leaves the cache (evicted for new KV, or freed without a hash) loses
its claim. Durations start when the block is freed, as in kvflow's node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from eventbus.protocol import DEFAULT_PRIORITY, GPU, BlockDigest
from inference_node.kv.block import IN_HEAP, IN_LIST, Block
from inference_node.kv.policy import PriorityRetention

#: A placeholder digest: a record in the order must look cached to kvflow's index.
_CACHED = BlockDigest(b"vllm")


class _Retention(PriorityRetention):
    """kvflow's priority order, telling the queue when a priority changes (an expiry)."""

    def __init__(self, clock: Callable[[], float], changed: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self._clock = clock
        self._changed = changed

    def _updated(self, b: Block, old: int, new: int) -> None:
        self._changed.append((b.uid, old, new))


def make_queue_class(base: type) -> type:
    """:class:`RetentionFreeQueue` over vLLM's ``FreeKVCacheBlockQueue`` (``base``), built when the
    plugin registers, so that this module imports without vLLM."""

    class RetentionFreeQueue(base):  # type: ignore[misc]
        """vLLM's free-block queue, its cached part in kvflow's retention order (module docstring)."""

        kvflow_retention = True

        def __init__(self, blocks: list[Any], clock: Callable[[], float] = time.monotonic) -> None:
            super().__init__(blocks)  # the front part: every block, in vLLM's order
            self._front = self.num_free_blocks
            #: priority changes the order made on its own (expiries): (block id, old, new)
            self.changed: list[tuple[int, int, int]] = []
            self._policy = _Retention(clock, self.changed)
            self._order = self._policy.orders[GPU]
            self._records: dict[int, Block] = {}
            self._claimed: set[int] = set()
            self._vllm: dict[int, Any] = {}

        # ------------------------------------------------------------ records and claims

        def _record(self, block: Any) -> Block:
            bid = block.block_id
            rec = self._records.get(bid)
            if rec is None:
                rec = self._records[bid] = Block(bid, bid, _CACHED)
                rec.ref = 0
                self._vllm[bid] = block
            return rec

        def claim(self, block: Any, priority: int, duration: float | None) -> None:
            """A request's retention for ``block`` (in use, cached): the first claim sets it, a
            later one only raises it (module docstring)."""
            rec = self._record(block)
            bid = block.block_id
            if bid in self._claimed:
                longer = duration is None or (rec.duration is not None and duration > rec.duration)
                if priority < rec.priority or (priority == rec.priority and not longer):
                    return
            self._claimed.add(bid)
            self._policy.set_priority(rec, priority, duration)

        def retention(self, block: Any) -> tuple[int, float | None]:
            """The priority and duration ``block`` has (35 and None: unclaimed)."""
            rec = self._records.get(block.block_id)
            return (DEFAULT_PRIORITY, None) if rec is None else (rec.priority, rec.duration)

        def _forget(self, block: Any) -> None:
            """``block`` holds no cached KV any more: its claim goes."""
            rec = self._records.get(block.block_id)
            if rec is not None and block.block_id in self._claimed:
                self._claimed.discard(block.block_id)
                self._order.rekey(rec, DEFAULT_PRIORITY)
                rec.duration = None
                rec.expiry_version += 1  # its clock, if any, is void

        # ------------------------------------------------------------ vLLM's queue API

        def popleft(self) -> Any:
            if self._front:
                self._front -= 1
                return super().popleft()
            self._policy.expire()
            rec = self._policy.victim(GPU)
            if rec is None:
                raise ValueError("No free blocks available")
            self.num_free_blocks -= 1
            block = self._vllm[rec.uid]
            self._forget(block)  # it is taken for new KV: vLLM drops its hash next
            return block

        def popleft_n(self, n: int) -> list[Any]:
            if n == 0:
                return []
            assert self.num_free_blocks >= n
            front = min(n, self._front)
            out = super().popleft_n(front) if front else []
            self._front -= front
            while len(out) < n:
                out.append(self.popleft())
            return out

        def remove(self, block: Any) -> None:
            if block.prev_free_block is not None and block.next_free_block is not None:
                self._front -= 1
                super().remove(block)
                return
            rec = self._records.get(block.block_id)
            if rec is None or rec.evict_state not in (IN_LIST, IN_HEAP):
                raise RuntimeError(f"remove() called on an invalid block: {block}")
            self._order.discard(rec)  # a prefix hit takes it into use
            if rec.duration is not None:
                rec.expiry_version += 1  # its retention clock stops while it is in use (as in kvflow's node)
            self.num_free_blocks -= 1

        def append(self, block: Any) -> None:
            self.append_n([block])

        def append_n(self, blocks: list[Any]) -> None:
            recs = []
            for block in blocks:
                rec = self._record(block)
                if block.block_hash is None:  # readable until reused (unpin_blocks), but holds no cache entry
                    self._forget(block)
                rec.ref = 1
                recs.append(rec)
            self._policy.release(recs, GPU, [])  # each evictable, the newest, its clock started
            self.num_free_blocks += len(recs)

        def prepend_n(self, blocks: list[Any]) -> None:
            for block in blocks:
                self._forget(block)
            super().prepend_n(blocks)
            self._front += len(blocks)

        def get_all_free_blocks(self) -> list[Any]:
            return list(self._in_order())

        def iter_blocks_after(self, cursor: Any) -> Iterator[Any]:
            seen = cursor is None
            for block in self._in_order():
                if seen:
                    yield block
                elif block is cursor:
                    seen = True

        def _in_order(self) -> Iterable[Any]:
            """Every free block in eviction order: the front part, then the retention order."""
            yield from super().get_all_free_blocks()
            self._policy.expire()
            listed = [r for r in self._records.values() if r.evict_state in (IN_LIST, IN_HEAP) and not r.ref]
            for rec in sorted(listed, key=lambda r: (r.priority, r.last_used)):
                yield self._vllm[rec.uid]

    return RetentionFreeQueue


__all__ = ["make_queue_class"]
