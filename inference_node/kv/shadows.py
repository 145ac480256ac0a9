"""The adaptive policy's tables keyed by block digests (:mod:`inference_node.kv.adaptive`): its
ghosts (evicted blocks it still remembers) and the guard's two shadows (small caches on sampled
digests, replayed beside the real one, so that the guard can compare its prefix hits with LRU's
and with the bands').

These Python classes, and :class:`~inference_node.kv.lifetables.LifeTables`, are the reference.
The optional ``kvflow_native`` extension (``native/``, Rust) has a compiled twin of each that
decides exactly the same, call for call, with no Python work per key or per block
(``tests/inference_node/kv/test_native_tables.py`` compares them); :func:`tables` hands out one
set or the other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from inference_node.kv.floor import ExactLru
from inference_node.kv.lifetables import LifeTables

if TYPE_CHECKING:
    from inference_node.kv.block import Block

try:
    import kvflow_native as _native
except ImportError:  # pure Python
    _native = None
if _native is not None and not hasattr(_native, "ExactLru"):  # an older build of the extension
    _native = None

#: A ghost's class in the low 7 bits of its value (with ``soon_share``, its last use above them).
CLASS_MASK = 127


def native_available() -> bool:
    """Whether the compiled tables are installed (``pip install ./native``)."""
    return _native is not None


class Tables(NamedTuple):
    """The classes of the adaptive policy's tables: one set, compiled or Python."""

    ghosts: Any
    lru: Any
    bands: Any
    life: Any
    #: the floor's exact LRU shadow (:class:`~inference_node.kv.floor.ExactLru`)
    exact: Any


def tables(compiled: bool) -> Tables:
    """The compiled classes when ``compiled`` and they are installed, else the Python ones
    (``GhostFifo``, ``LruShadow``, ``BandsShadow`` here, ``LifeTables`` and ``ExactLru``)."""
    if compiled and _native is not None:
        return Tables(_native.GhostFifo, _native.LruShadow, _native.BandsShadow, _native.LifeTables,
                      _native.ExactLru)
    return Tables(GhostFifo, LruShadow, BandsShadow, LifeTables, ExactLru)


def _sample(digests: Sequence[bytes], matched: int, below: int) -> tuple[list[bytes], int]:
    """A lookup's sampled digests (first byte below ``below``), and how many of them are among the
    first ``matched`` (the cache's own prefix hits on them)."""
    sampled = [d for d in digests if d and d[0] < below]
    own = len([d for d in digests[:matched] if d and d[0] < below]) if matched else 0
    return sampled, own


class GhostFifo:
    """Evicted blocks' digests -> value (their adaptive class; with ``soon`` also their last use:
    ``last_used << 7 | class``), oldest first, at most ``capacity``."""

    __slots__ = ("capacity", "ghosts")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.ghosts)

    def add(self, blocks: Sequence[Block], soon: bool) -> list[tuple[int, int]]:
        """Remember the evicted ``blocks`` (digests still set) that have an adaptive class
        (>= 0; a block remembered already keeps its place, with the new value), then forget the
        oldest beyond the capacity: their classes, as (class, count) pairs by class."""
        ghosts = self.ghosts
        if soon:
            for b in blocks:
                if b.adaptive_class >= 0:
                    ghosts[b.digest] = b.last_used << 7 | b.adaptive_class  # type: ignore[index]
        else:
            ghosts.update([(b.digest, b.adaptive_class) for b in blocks if b.adaptive_class >= 0])  # type: ignore[misc]
        excess = len(ghosts) - self.capacity
        if excess <= 0:
            return []
        pop = ghosts.popitem
        left: dict[int, int] = {}
        for _ in range(excess):
            cls = pop(last=False)[1] & CLASS_MASK
            left[cls] = left.get(cls, 0) + 1
        return sorted(left.items())

    def take(self, digests: Sequence[bytes], start: int) -> list[tuple[int, int]]:
        """Forget the ghosts among ``digests[start:]``: (index, value) of each one that was there."""
        ghosts = self.ghosts
        if not ghosts:
            return []
        pop = ghosts.pop
        out = []
        for i in range(start, len(digests)):
            v = pop(digests[i], None)
            if v is not None:
                out.append((i, v))
        return out


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

    def __len__(self) -> int:
        return len(self.keys)

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

    def lookup(self, digests: Sequence[bytes], matched: int, below: int) -> tuple[int, int, int]:
        """One lookup of a prompt's ``digests``, of which the cache had the first ``matched``: the
        sampled ones (first byte below ``below``) are replayed. Returns (sampled, the cache's own
        prefix hits among them, the shadow's)."""
        sampled, own = _sample(digests, matched, below)
        return len(sampled), own, self.replay(sampled)


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

    def __len__(self) -> int:
        """Keys held in both lists."""
        return len(self.new) + len(self.old)

    @property
    def num_ghosts(self) -> int:
        return len(self.ghosts)

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

    def lookup(self, digests: Sequence[bytes], matched: int, below: int) -> tuple[int, int, int]:
        """As :meth:`LruShadow.lookup`."""
        sampled, own = _sample(digests, matched, below)
        return len(sampled), own, self.replay(sampled)


class StrictGuard:
    """The life tables' guard (:mod:`inference_node.kv.adaptive`, "The life tables' guard"): a
    shadow of strict bands (:class:`BandsShadow` or its compiled twin) against the cache while the
    bands are on; :attr:`on` (strict bands: the tables demote nothing) once it leads the cache by
    the guard's margin in the guard's moving average; :meth:`off` when the cache, strict, falls
    behind the LRU shadow."""

    __slots__ = ("hold", "lead", "on", "seen", "shadow", "switches")

    def __init__(self, shadow: Any) -> None:
        self.shadow = shadow
        self.on = False
        #: How often strict bands turned on or off.
        self.switches = 0
        #: Moving average of the shadow's sampled prefix hits minus the cache's.
        self.lead = 0.0
        self.seen = 0  # sampled lookups since strict bands turned on or off
        self.hold = 0  # ... before they may turn on again

    def step(self, digests: Sequence[bytes], matched: int, below: int, rate: float, margin: float) -> None:
        """One lookup (``below``: the sampling threshold); ``rate``: the moving average's weight,
        ``margin``: the lead, in sampled hits per lookup, that turns strict bands on."""
        n, own, other = self.shadow.lookup(digests, matched, below)
        if not n:
            return
        self.seen += 1
        self.lead += rate * ((other - own) - self.lead)
        if not self.on and self.seen >= self.hold and self.lead > margin:
            self.on = True
            self.seen = 0
            self.switches += 1

    def off(self, base: int) -> None:
        """Strict bands fell behind the LRU shadow: the tables demote again, and strict bands may
        return only after a hold of ``base`` sampled lookups (the guard's horizon), doubled after
        each strict stretch shorter than the hold before it — so that the LRU guard gets its turn
        where neither kind of bands is ahead of LRU."""
        self.on = False
        self.switches += 1
        self.hold = base if self.seen >= self.hold else max(base, 2 * self.hold)
        self.seen = 0
        self.lead = 0.0

    def describe(self) -> dict[str, object]:
        return {"on": self.on, "switches": self.switches, "lead": round(self.lead, 4), "hold": self.hold}
