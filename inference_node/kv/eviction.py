"""The eviction order of one tier: lowest priority first, least recently used first within it,
leaves only.

Per priority, evictable blocks sit in an ``OrderedDict`` in release order. A block released now
has the newest ``last_used`` of all, so the common case (release) is an O(1) append, and taking
the victim an O(1) pop from the front of the lowest non-empty priority (found with a bitmask).
A block whose position is older than the tail of its list (its priority changed while evictable,
it moved tiers, it waited for its children) goes to a small per-priority heap instead, and the
victim is the older of the two fronts, so the order stays exact.

Non-leaves may sit in the lists: a parent is released after its children, so it sits behind
them and becomes a leaf before it reaches the front. If one reaches the front anyway (its
children have a higher priority), it is *parked* until its last child leaves the tier, then put
back at its exact position (:meth:`EvictionIndex.unpark`).

Blocks in use may sit in the lists too: a block taken into use from a list stays there,
*pinned* (:meth:`EvictionIndex.pin`), and is skipped (and dropped from its list) when it
reaches the front. Released again, it moves to the back of its list (``move_to_end``, cheaper
than deleting it when it is taken and appending it when it is released). It is not evictable
while pinned, and not counted.

Costs: add, discard, pin and unpark O(1) amortized (O(log n) on the heap path); pop O(1)
amortized plus O(log n) heap work, with a scan over at most 101 priorities done by bit
arithmetic.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference_node.kv.manager import Block

NUM_PRIORITIES = 101

# Block.cand states
NOT_EVICTABLE = 0
IN_LIST = 1
IN_HEAP = 2
PARKED = 3
PINNED = 4  # in use, but still in its list (not evictable, not counted)


class EvictionIndex:
    """Evictable blocks of one tier in eviction order (see the module docstring)."""

    __slots__ = ("_heap_entries", "_heap_live", "_heaps", "_is_leaf", "_lists", "_mask", "_tails", "count")

    def __init__(self, is_leaf: Callable[[Block], bool]) -> None:
        self._lists: list[OrderedDict[Block, None]] = [OrderedDict() for _ in range(NUM_PRIORITIES)]
        self._heaps: list[list[tuple[int, int, int, Block]]] = [[] for _ in range(NUM_PRIORITIES)]
        self._tails = [-1] * NUM_PRIORITIES  # last_used of the newest entry ever appended
        self._mask = 0  # bit p set: priority p may hold entries
        self._is_leaf = is_leaf
        self._heap_entries = 0  # entries in all heaps, stale ones included
        self._heap_live = 0
        self.count = 0  # evictable blocks, parked ones included

    def add(self, b: Block) -> None:
        """``b`` became evictable (or changed priority / tier while evictable)."""
        p = b.priority
        if b.cand == PINNED:  # still in its list
            if b.last_used >= self._tails[p]:
                self._lists[p].move_to_end(b)
                self._tails[p] = b.last_used
                b.cand = IN_LIST
                self._mask |= 1 << p
                self.count += 1
                return
            del self._lists[p][b]
            b.cand = NOT_EVICTABLE
        if b.last_used >= self._tails[p]:
            self._lists[p][b] = None
            self._tails[p] = b.last_used
            b.cand = IN_LIST
        else:
            b.side_ver += 1
            heapq.heappush(self._heaps[p], (b.last_used, b.uid, b.side_ver, b))
            b.cand = IN_HEAP
            self._heap_entries += 1
            self._heap_live += 1
            if self._heap_entries > 2 * self._heap_live + 256:
                self._compact()
        self._mask |= 1 << p
        self.count += 1

    def _compact(self) -> None:
        """Drop the stale heap entries that lazy deletion leaves behind."""
        for i, heap in enumerate(self._heaps):
            if heap:
                live = [e for e in heap if e[3].cand == IN_HEAP and e[3].side_ver == e[2]]
                heapq.heapify(live)
                self._heaps[i] = live
        self._heap_entries = self._heap_live

    def add_released(self, blocks: list[Block]) -> None:
        """Blocks just released, each newer than everything here (the release fast path)."""
        lists, tails = self._lists, self._tails
        mask = self._mask
        for b in blocks:
            p = b.priority
            if b.cand == PINNED:
                lists[p].move_to_end(b)
            else:
                lists[p][b] = None
            tails[p] = b.last_used
            b.cand = IN_LIST
            mask |= 1 << p
        self._mask = mask
        self.count += len(blocks)

    def pin(self, b: Block) -> None:
        """``b`` is taken into use: it leaves the order (a listed block stays in its list, pinned)."""
        if b.cand == IN_LIST:
            b.cand = PINNED
            self.count -= 1
        else:
            self.discard(b)

    def discard(self, b: Block) -> None:
        """``b`` is no longer here, evictable or pinned (in use, removed, moved, or re-keyed)."""
        cand = b.cand
        if cand == NOT_EVICTABLE:
            return
        if cand == PINNED:
            del self._lists[b.priority][b]
            b.cand = NOT_EVICTABLE
            return
        if cand == IN_LIST:
            del self._lists[b.priority][b]
        elif cand == IN_HEAP:
            b.side_ver += 1  # its heap entry goes stale
            self._heap_live -= 1
        b.cand = NOT_EVICTABLE
        self.count -= 1

    def unpark(self, b: Block) -> None:
        """A parked block became a leaf: back into the order, at its exact position."""
        if b.cand == PARKED:
            b.cand = NOT_EVICTABLE
            self.count -= 1
            self.add(b)

    def pop(self) -> Block | None:
        """Remove and return the victim: the lowest (priority, last_used) leaf; None if none."""
        mask = self._mask
        while mask:
            p = (mask & -mask).bit_length() - 1
            lst = self._lists[p]
            heap = self._heaps[p]
            while heap and (heap[0][3].cand != IN_HEAP or heap[0][3].side_ver != heap[0][2]):
                heapq.heappop(heap)
                self._heap_entries -= 1
            while lst:
                b = next(iter(lst))
                if b.cand != PINNED:
                    break
                del lst[b]  # in use: it returns to the back when released
                b.cand = NOT_EVICTABLE
            if lst:
                if heap and heap[0][0] < b.last_used:
                    b = heapq.heappop(heap)[3]
                    self._heap_entries -= 1
                    self._heap_live -= 1
                else:
                    del lst[b]
            elif heap:
                b = heapq.heappop(heap)[3]
                self._heap_entries -= 1
                self._heap_live -= 1
            else:
                mask &= ~(1 << p)
                self._mask = mask
                continue
            if self._is_leaf(b):
                b.cand = NOT_EVICTABLE
                self.count -= 1
                return b
            b.cand = PARKED  # still counted: it is evictable once its children go
        return None
