"""The eviction order of one tier: lowest priority first, least recently used first within it,
leaves only.

Per priority, evictable blocks sit in an ``OrderedDict`` in release order. A block released now
has the newest ``last_used`` of all, so the common case (release) is an O(1) append, and taking
the victim an O(1) pop from the front of the lowest non-empty priority (found with a bitmask).
A block whose position is older than the tail of its list (its priority changed while evictable,
it moved tiers, it waited for its children) goes to a small per-priority heap instead, and the
victim is the older of the two fronts, so the order stays exact.

A *leaf* of a tier is a block with no cached child on that tier: on the GPU, no child on the
GPU; on the host tier, no child at all (a host block's children are all on the host). Non-leaves
may sit in the lists: a parent is released after its children, so it sits behind them and
becomes a leaf before it reaches the front. If one reaches the front anyway (its children have a
higher priority), it is *parked* until its last child leaves the tier, then put back at its
exact position (:meth:`EvictionIndex.unpark`; :meth:`EvictionIndex.take` does it for the victims
it hands out).

Blocks in use may sit in the lists too: a block taken into use from a list stays there,
*pinned* (:meth:`EvictionIndex.pin_listed`), and is skipped (and dropped from its list) when it
reaches the front. Released again, it moves to the back of its list (``move_to_end``, cheaper
than deleting it when it is taken and appending it when it is released). It is not evictable
while pinned, and not counted. (A block is pinned when it sits in a list with ``ref > 0``.)

The index owns ``Block.evict_state``, ``Block.heap_version`` and, through :meth:`release`, the
release side of ``Block.ref`` and ``Block.last_used`` (whether and where a block is evictable).
The pool changes the order only through these methods, in batches on its hot paths
(:meth:`release`, :meth:`pin_listed`, :meth:`take`), so that no call per block is added there.

Costs: add, discard, rekey and unpark O(1) amortized (O(log n) on the heap path); release O(1)
per block; take O(1) amortized per victim plus O(log n) heap work, with a scan over at most 101
priorities done by bit arithmetic.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from inference_node.kv.block import GPU, IN_HEAP, IN_LIST, NOT_EVICTABLE, PARKED, Block

NUM_PRIORITIES = 101


class EvictionIndex:
    """Evictable blocks of one tier in eviction order (see the module docstring)."""

    __slots__ = ("_gpu", "_heap_entries", "_heap_live", "_heaps", "_level", "_lists", "_mask", "_tails", "arrived",
                 "count")

    def __init__(self, level: int) -> None:
        self._level = level
        self._gpu = level == GPU  # the tier's leaf rule: no child on the GPU / no child at all
        self._lists: list[OrderedDict[Block, None]] = [OrderedDict() for _ in range(NUM_PRIORITIES)]
        self._heaps: list[list[tuple[int, int, int, Block]]] = [[] for _ in range(NUM_PRIORITIES)]
        self._tails = [-1] * NUM_PRIORITIES  # last_used of the newest entry ever appended
        self._mask = 0  # bit p set: priority p may hold entries
        self._heap_entries = 0  # entries in all heaps, stale ones included
        self._heap_live = 0
        #: Evictable blocks, parked ones included.
        self.count = 0
        #: Blocks made evictable by :meth:`release`, per priority, since the caller last reset
        #: them (the adaptive policy's life tables count arrivals in their bands so).
        self.arrived = [0] * NUM_PRIORITIES

    def is_leaf(self, b: Block) -> bool:
        """``b`` has no cached child on this tier."""
        return (b.gpu_children if self._gpu else b.children) == 0

    # ---------------------------------------------------------------- entering and leaving

    def release(self, blocks: Iterable[Block], tick: int, freed: list[int], clocks: list[Block]) -> int:
        """A request's blocks in release order (tail first), no longer used by it: each cached one
        loses a user (``ref``), and one that no request uses any more becomes evictable, the
        newest of all (``last_used`` the next tick), at the back of its priority's list (a pinned
        one is there already and moves to the back).

        Args:
            blocks: the blocks; a private one (no digest) is in no order: its slot goes to ``freed``.
            tick: the last tick handed out (recency is shared by both tiers' orders).
            freed: receives the slots of private blocks.
            clocks: receives the blocks that became evictable and have a retention duration:
                the caller starts their clocks.

        Returns:
            The last tick handed out.
        """
        # NOTE: one pass for the reference counts and the order. With the pool counting down and
        # this loop only ordering (two passes), ``kvflow bench kv``'s workload ran 9 % more
        # bytecodes in all (counted with sys.settrace opcode tracing, 10,000 requests).
        lists, tails, arrived = self._lists, self._tails, self.arrived
        p = -1
        lst = lists[0]
        n = start = 0
        for b in blocks:
            if b.digest is None:
                freed.append(b.slot)
                continue
            b.ref -= 1
            if b.ref:
                continue
            tick += 1
            b.last_used = tick
            if b.duration is not None:
                clocks.append(b)
            if b.priority != p:  # a run of one priority ends: its tail is the run's last block
                if n:
                    tails[p] = tick - 1
                    arrived[p] += n - start
                    start = n
                p = b.priority
                lst = lists[p]
                self._mask |= 1 << p
            if b.evict_state == IN_LIST:  # pinned: in use while in its list
                lst.move_to_end(b)
            else:
                lst[b] = None
                b.evict_state = IN_LIST
            n += 1
        if n:
            tails[p] = tick
            arrived[p] += n - start
        self.count += n
        return tick

    def pin_listed(self, n: int) -> None:
        """``n`` evictable blocks that sit in their lists were taken into use: they stay there,
        *pinned* (eviction skips and drops a block in use that reaches the front; its release
        moves it to the back), and are not counted. Any other evictable block taken into use
        leaves the order through :meth:`discard`."""
        self.count -= n

    def add(self, b: Block) -> None:
        """``b``, in no order now, becomes evictable (it changed priority or tier, waited for its
        children, or could not be evicted after all)."""
        p = b.priority
        if b.last_used >= self._tails[p]:
            self._lists[p][b] = None
            self._tails[p] = b.last_used
            b.evict_state = IN_LIST
        else:
            b.heap_version += 1
            heapq.heappush(self._heaps[p], (b.last_used, b.uid, b.heap_version, b))
            b.evict_state = IN_HEAP
            self._heap_entries += 1
            self._heap_live += 1
            if self._heap_entries > 2 * self._heap_live + 256:
                self._compact()
        self._mask |= 1 << p
        self.count += 1

    def discard(self, b: Block) -> None:
        """``b`` leaves the order, evictable or pinned (taken into use, removed, moved, re-keyed)."""
        state = b.evict_state
        if state == NOT_EVICTABLE:
            return
        if state == IN_LIST:
            del self._lists[b.priority][b]
        elif state == IN_HEAP:
            b.heap_version += 1  # its heap entry goes stale
            self._heap_live -= 1
        b.evict_state = NOT_EVICTABLE
        if not b.ref:
            self.count -= 1

    def rekey(self, b: Block, priority: int) -> None:
        """Set the priority of a block of this tier; an evictable one moves in the order, a pinned
        one only leaves its list (its release puts it back)."""
        state = b.evict_state
        if state == NOT_EVICTABLE:
            b.priority = priority
            return
        self.discard(b)
        b.priority = priority
        if not b.ref:
            self.add(b)

    def unpark(self, b: Block) -> None:
        """A child of ``b`` left the tier: a parked ``b`` that is a leaf now goes back into the
        order, at its exact position."""
        if b.evict_state == PARKED and self.is_leaf(b):
            b.evict_state = NOT_EVICTABLE
            self.count -= 1
            self.add(b)

    # ---------------------------------------------------------------- the adaptive policy's reads

    def listed(self, priority: int) -> int:
        """Entries of one priority's list and heap (pinned blocks and stale heap entries included:
        what the adaptive policy's target compares, cheaply)."""
        return len(self._lists[priority]) + len(self._heaps[priority])

    def listed_below(self, priority: int) -> int:
        """Entries of the lists and heaps of every priority below ``priority`` (what eviction
        takes first; pinned blocks and stale heap entries included)."""
        mask = self._mask & ((1 << priority) - 1)
        n = 0
        while mask:
            p = (mask & -mask).bit_length() - 1
            n += len(self._lists[p]) + len(self._heaps[p])
            mask &= mask - 1
        return n

    def front(self, priority: int) -> Iterator[Block]:
        """The evictable (unpinned) blocks of one priority's list, oldest first (a generator: read
        what you need; do not change the order meanwhile)."""
        return (b for b in self._lists[priority] if not b.ref)

    # ---------------------------------------------------------------- victims

    def take(self, k: int) -> list[Block]:
        """Up to ``k`` victims that leave the cache, in eviction order (a run of one priority from
        a list; when a heap is involved, victims one by one, possibly of several priorities);
        empty when nothing is evictable.

        Each victim's parent loses a cached child here (``children``, and ``gpu_children`` on the
        GPU tier), so that it can be the next victim of the same run; a parked parent that becomes
        a leaf goes back into the order, and the run ends there (the parent may come first). The
        caller does the rest of each removal (the digest map, the slot, the event).

        The common case is a run popped from the front of the lowest priority's list; when that
        priority's heap holds entries, the two fronts are compared, one victim at a time.
        """
        mask = self._mask
        if not mask:
            return []
        p = (mask & -mask).bit_length() - 1
        run: list[Block] = []
        heap = self._heaps[p]
        if heap:  # the fronts of the list and the heap compete: one victim at a time, while it lasts
            pop, leave = self.pop, self._leave
            while len(run) < k and heap:
                b = pop()
                if b is None:
                    break
                run.append(b)
                leave(b)
            return run
        lst = self._lists[p]
        gpu = self._gpu
        append = run.append
        n = 0
        while lst:
            b = lst.popitem(last=False)[0]
            if b.ref:  # pinned: it returns to the back when released
                b.evict_state = NOT_EVICTABLE
                continue
            if b.gpu_children if gpu else b.children:
                b.evict_state = PARKED  # still counted: it is evictable once its children go
                continue
            b.evict_state = NOT_EVICTABLE
            append(b)
            n += 1
            par = b.parent
            if par is not None:  # _leave(b), inlined
                par.children -= 1
                if gpu:
                    par.gpu_children -= 1
                if par.evict_state == PARKED and self._leave_unparks(par):
                    break
            if n == k:
                break
        self.count -= n
        if not n:  # this priority held only pinned and parked blocks: look further
            self._mask = mask & ~(1 << p)
            return self.take(k)
        return run

    def _leave(self, b: Block) -> None:
        """``b``, taken from here, leaves the cache: its parent loses a child (see :meth:`take`)."""
        par = b.parent
        if par is not None:
            par.children -= 1
            if self._gpu:
                par.gpu_children -= 1
            if par.evict_state == PARKED:
                self._leave_unparks(par)

    def _leave_unparks(self, par: Block) -> bool:
        """A parked parent lost a child: back into the order if it is a leaf of this tier now."""
        if par.level != self._level or not self.is_leaf(par):
            return False  # parked in the other tier's order, or still a parent here
        self.unpark(par)
        return True

    def pop(self) -> Block | None:
        """Remove and return the victim: the lowest (priority, last_used) leaf; None if none."""
        mask = self._mask
        while mask:
            p = (mask & -mask).bit_length() - 1
            lst = self._lists[p]
            heap = self._heaps[p]
            while heap and (heap[0][3].evict_state != IN_HEAP or heap[0][3].heap_version != heap[0][2]):
                heapq.heappop(heap)
                self._heap_entries -= 1
            while lst:
                b = next(iter(lst))
                if not b.ref:
                    break
                del lst[b]  # pinned: it returns to the back when released
                b.evict_state = NOT_EVICTABLE
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
            if self.is_leaf(b):
                b.evict_state = NOT_EVICTABLE
                self.count -= 1
                return b
            b.evict_state = PARKED  # still counted: it is evictable once its children go
        return None

    def _compact(self) -> None:
        """Drop the stale heap entries that lazy deletion leaves behind."""
        for i, heap in enumerate(self._heaps):
            if heap:
                live = [e for e in heap if e[3].evict_state == IN_HEAP and e[3].heap_version == e[2]]
                heapq.heapify(live)
                self._heaps[i] = live
        self._heap_entries = self._heap_live
