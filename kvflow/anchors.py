"""Eviction anchors written from their papers, with prefix semantics, for the hit-rate replays.

A request hits the longest run of its blocks *from the start* that is cached (a KV prefix: a
block past a missing one is recomputed whatever is cached), then every block of the request is
accessed in order (a hit updates the policy's state, a miss inserts the block, evicting as the
policy says). The same accounting as ``kvflow.traces.belady_hit_rate``.

* :func:`arc_hit_rate` — ARC (Megiddo & Modha, FAST 2003): two LRU lists, T1 (seen once lately) and
  T2 (seen at least twice), ghost lists B1 and B2 of what each evicted, and the target size ``p``
  of T1, moved by ghost hits: a hit in B1 says recency was evicted too soon, one in B2 frequency.
* :func:`s3fifo_hit_rate` — S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10 % of the cache)
  for new blocks, a main FIFO with 2-bit access counts (reinsertion while the count lasts), and a
  ghost FIFO of keys evicted from the small one (as many as the main one holds): a block seen
  again while a ghost goes straight to main; one not touched while in the small FIFO leaves early.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvflow.traces import ReplayResult


def _prefix_hits(keys: Sequence[int], cached: object) -> int:
    n = 0
    for k in keys:
        if k not in cached:  # type: ignore[operator]
            break
        n += 1
    return n


class Arc:
    """ARC over block keys (the paper's Fig. 4, ``c`` = capacity)."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, k: int) -> bool:
        return k in self.t1 or k in self.t2

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and ((in_b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            k, _ = self.t1.popitem(last=False)
            self.b1[k] = None
        elif self.t2:
            k, _ = self.t2.popitem(last=False)
            self.b2[k] = None
        else:  # T2 empty: take from T1 after all
            k, _ = self.t1.popitem(last=False)
            self.b1[k] = None

    def access(self, k: int) -> None:
        c = self.c
        if k in self.t1:
            del self.t1[k]
            self.t2[k] = None
        elif k in self.t2:
            self.t2.move_to_end(k)
        elif k in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(False)
            del self.b1[k]
            self.t2[k] = None
        elif k in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(True)
            del self.b2[k]
            self.t2[k] = None
        else:
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 == c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                    self._replace(False)
                else:
                    self.t1.popitem(last=False)
            elif l1 < c and total >= c:
                if total == 2 * c:
                    self.b2.popitem(last=False)
                self._replace(False)
            self.t1[k] = None


class S3Fifo:
    """S3-FIFO over block keys (the paper's Algorithm 1; small FIFO 10 %, counts capped at 3)."""

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        self.small_cap = max(1, int(capacity * small_fraction))
        self.main_cap = max(1, capacity - self.small_cap)
        self.small: OrderedDict[int, int] = OrderedDict()  # key -> count; oldest first
        self.main: OrderedDict[int, int] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, k: int) -> bool:
        return k in self.small or k in self.main

    def access(self, k: int) -> None:
        if k in self.small:
            self.small[k] = min(self.small[k] + 1, 3)
            return
        if k in self.main:
            self.main[k] = min(self.main[k] + 1, 3)
            return
        while len(self.small) + len(self.main) >= self.small_cap + self.main_cap:
            self._evict()
        if k in self.ghost:
            del self.ghost[k]
            self.main[k] = 0
        else:
            self.small[k] = 0

    def _evict(self) -> None:
        if len(self.small) >= self.small_cap:
            self._evict_small()
        else:
            self._evict_main()

    def _evict_small(self) -> None:
        while self.small:
            k, count = self.small.popitem(last=False)
            if count > 0:  # touched while in the small FIFO: promoted
                self.main[k] = 0
                if len(self.main) > self.main_cap:
                    self._evict_main()
            else:
                self.ghost[k] = None
                if len(self.ghost) > self.main_cap:
                    self.ghost.popitem(last=False)
                return

    def _evict_main(self) -> None:
        while self.main:
            k, count = self.main.popitem(last=False)
            if count > 0:
                self.main[k] = count - 1  # reinserted at the head
            else:
                return


def _replay(policy: Arc | S3Fifo, name: str, keys_per_request: Sequence[Sequence[int]], capacity: int) -> ReplayResult:
    hits = total = 0
    for ks in keys_per_request:
        total += len(ks)
        hits += _prefix_hits(ks, policy)
        for k in ks:
            policy.access(k)
    return ReplayResult(name, capacity, hits, total)


def arc_hit_rate(keys_per_request: Sequence[Sequence[int]], capacity: int) -> ReplayResult:
    """ARC's prefix hit rate on one cache of ``capacity`` blocks."""
    return _replay(Arc(capacity), "arc", keys_per_request, capacity)


def s3fifo_hit_rate(keys_per_request: Sequence[Sequence[int]], capacity: int) -> ReplayResult:
    """S3-FIFO's prefix hit rate on one cache of ``capacity`` blocks."""
    return _replay(S3Fifo(capacity), "s3fifo", keys_per_request, capacity)
