"""The adaptive policy's guard shadows (:mod:`inference_node.kv.adaptive`): two small caches on
sampled block keys, replayed beside the real one, so that the guard can compare its prefix hits
with LRU's and with the bands'."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class LruShadow:
    """Plain LRU on block keys, for the guard. ``timed``: it also keeps each key's last use, for
    :attr:`horizon` (the adaptive policy's ``frequency_horizons`` reads it; off, nothing reads it)."""

    __slots__ = ("capacity", "horizon", "keys", "now", "timed")

    def __init__(self, capacity: int, timed: bool = True) -> None:
        self.capacity = capacity
        self.timed = timed
        self.keys: OrderedDict[bytes, float] = OrderedDict()  # key -> last use (0 untimed)
        #: The time of the lookup being replayed, and how long ago the oldest entry was used.
        self.now = 0.0
        self.horizon = 0.0

    def replay(self, keys: Sequence[bytes]) -> int:
        """One lookup of ``keys`` (a prompt's sampled blocks, in order): its prefix hits."""
        cached = self.keys
        now = self.now if self.timed else 0.0
        hits = 0
        hit = True
        for d in keys:
            if hit and d in cached:
                hits += 1
                cached.move_to_end(d)
                if now:
                    cached[d] = now
            else:
                hit = False
                cached[d] = now
        excess = len(cached) - self.capacity
        if excess > 0:
            for _ in range(excess):
                cached.popitem(last=False)
            if self.timed:
                self.horizon = self.now - next(iter(cached.values()))
        return hits


class BandsShadow:
    """The bands on block keys, for the guard: a probationary LRU list (seen once) evicted before
    a protected one (seen twice, or returning while a ghost), and a FIFO of evicted keys."""

    __slots__ = ("capacity", "ghost_capacity", "ghosts", "new", "old")

    def __init__(self, capacity: int, ghost_capacity: int) -> None:
        self.capacity = capacity
        self.ghost_capacity = ghost_capacity
        self.new: OrderedDict[bytes, None] = OrderedDict()
        self.old: OrderedDict[bytes, None] = OrderedDict()
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()

    def replay(self, keys: Sequence[bytes]) -> int:
        """One lookup of ``keys`` (a prompt's sampled blocks, in order): its prefix hits."""
        new, old, ghosts = self.new, self.old, self.ghosts
        hits = 0
        hit = True
        for d in keys:
            if d in old:
                hits += hit
                old.move_to_end(d)
            elif d in new:
                hits += hit
                del new[d]
                old[d] = None
            else:
                hit = False
                if d in ghosts:  # a miss on a ghost: back to the protected list
                    del ghosts[d]
                    old[d] = None
                else:
                    new[d] = None
        excess = len(new) + len(old) - self.capacity
        for _ in range(excess if excess > 0 else 0):  # the probationary list first
            ghosts[(new if new else old).popitem(last=False)[0]] = None
        excess = len(ghosts) - self.ghost_capacity
        for _ in range(excess if excess > 0 else 0):
            ghosts.popitem(last=False)
        return hits
