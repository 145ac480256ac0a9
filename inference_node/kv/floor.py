"""The adaptive policy's floor against LRU: an exact LRU shadow, the hits it would have kept, and
the rule that hands the cache to plain LRU when the policy falls behind it.

The adaptive policy (:mod:`inference_node.kv.adaptive`) keeps blocks LRU would evict (a frequency
band) and evicts blocks LRU would keep (a junk band, the life tables' demotions). Its guard compares
*sampled* shadows in a moving average with a margin in blocks looked up: a loss that is small
against the blocks looked up but large against LRU's hits (LRU hitting a few per cent of them) stays
below it, and with the bands off nothing compares the junk band with LRU at all. The floor is the
outer check that bounds the policy's loss against LRU's **hits**, whatever the inner mechanisms do:

* **What it compares.** :class:`ExactLru` replays every lookup through plain LRU of the cache's
  size, on every block (no sampling), touching a prompt's blocks as the pool releases them (its
  last block first, so its first block is the newest and leaves last). Per lookup, ``D`` (LRU's
  prefix hits minus the cache's, summed since the start) and ``L`` (LRU's hits) grow; the floor
  watches ``X = D - share * L``: the policy's loss beyond ``share`` of LRU's hits.
* **When it switches.** While the policy runs, ``low`` is the least ``X`` since it (re)started;
  once ``X - low > blocks``, the floor engages: over any stretch of lookups since ``low`` the policy
  lost more than ``blocks + share * L`` of that stretch. Checked after every lookup, so the loss
  at the switch is at most that plus one prompt's blocks.
* **What it switches to.** Exact LRU over the cache's contents: the core returns every block the
  policy placed (junk, demoted, frequency) to the default priority, at its place in recency, and
  new and reused blocks stay there. Every block the cache then holds that LRU's shadow does not is
  older than every block the shadow holds (LRU keeps the most recent ones), so eviction takes those
  first; each block the shadow holds and the cache does not costs at most one miss, after which
  the cache holds it. The cost of a switch is at most the blocks of the shadow missing from the
  cache (:attr:`LruFloor.missing` counts them at the switch) and at most the cache's size; after
  it the cache keeps exactly LRU's hits.
* **When it retries.** After ``retry`` x the cache's size in blocks looked up, the policy runs
  again from LRU's contents. An episode that ends with ``X`` above where it started (the policy
  lost, net, more than ``share`` of LRU's hits over it, the switch included) doubles the wait; one
  that does not restores it. So a trace that defeats the policy every time pays for a logarithmic
  number of retries, and a trace where it gains keeps it running.

**The bound.** Over any window of lookups, the policy's hits fall short of LRU's by at most
``share`` x LRU's hits in the window, plus ``blocks`` + one prompt + the switch's cost (at most the
cache's size) for each switch in the window; the switches in a window of ``W`` blocks looked up
number at most about ``log2(W / (retry x size)) + 2`` when every retry fails. No online policy that
ever departs from LRU can bound the constant below a switch's cost: a trace can always ask next for
exactly the blocks it kept and LRU did not (docs/kv-core.md, "The floor"). Measured on traces built
to defeat it, and which data chose the settings: docs/benchmarks.md ("The floor").

**Beside running requests.** The bound is exact where requests do not overlap (a replay). In a
node, a request's generated blocks are cached too and no lookup brings them: the core hands each to
the shadow as it stores it (:meth:`ExactLru.touch`), as LRU would hold it; and the slots other
running requests hold with no cached block in them (their unfinished blocks) are left out of the
shadow's room at each lookup. On the golden replays of
``tests/inference_node/kv/test_replay_equivalence.py`` (four requests in flight) the shadow then
counts 0.08 % more hits for LRU than an LRU core keeps at 600 blocks and 3.5 % more at 160: there
the floor errs toward engaging early.

The shadow has a compiled twin (``kvflow_native.ExactLru``, ``native/src/floor.rs``), used with
the policy's other compiled tables. The reference is LRU on every block the cache is asked for or
fills; a client's retention config places its blocks outside it (the floor moves only the blocks
the policy placed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Any

__all__ = ["ExactLru", "LruFloor"]


class ExactLru:
    """Plain LRU of ``capacity`` blocks on every key, in the core's order: a prompt's prefix hits
    counted front to back, its blocks then touched last to first (the pool releases a request's
    blocks in reverse, so that its first block is the newest)."""

    __slots__ = ("capacity", "keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def replay(self, digests: Sequence[bytes], room: int | None = None) -> int:
        """One lookup: its prefix hits; then the prompt's blocks are the newest. ``room``: hold at
        most so many blocks after it (the cache less the slots other requests hold with no cached
        block in them; at most the capacity)."""
        keys = self.keys
        hits = 0
        for d in digests:
            if d not in keys:
                break
            hits += 1
        move = keys.move_to_end
        for d in reversed(digests):
            if d in keys:
                move(d)
            else:
                keys[d] = None
        excess = len(keys) - (self.capacity if room is None else max(1, min(room, self.capacity)))
        pop = keys.popitem
        for _ in range(excess if excess > 0 else 0):
            pop(last=False)
        return hits

    def touch(self, digest: bytes) -> None:
        """A block stored without a lookup (a generated one): the newest, as LRU would hold it."""
        keys = self.keys
        if digest in keys:
            keys.move_to_end(digest)
        else:
            keys[digest] = None
            if len(keys) > self.capacity:
                keys.popitem(last=False)

    def missing_from(self, cached: Container[bytes]) -> int:
        """How many of the shadow's keys ``cached`` does not hold."""
        return sum(1 for d in self.keys if d not in cached)


class LruFloor:
    """The floor's state on one cache of ``capacity`` blocks (module docstring): ``share`` and
    ``blocks`` the loss it tolerates, ``retry`` the first wait, in caches' worth of blocks looked
    up, before the policy runs again; ``shadow``: the class of the exact shadow (:class:`ExactLru`,
    or its compiled twin: :func:`inference_node.kv.shadows.tables`)."""

    __slots__ = (
        "blocks",
        "deficit",
        "engaged",
        "low",
        "lru",
        "lru_hits",
        "missing",
        "retry",
        "retry_base",
        "seen",
        "share",
        "start",
        "switches",
    )

    def __init__(self, capacity: int, share: float, blocks: float, retry: float, shadow: Any = ExactLru) -> None:
        self.lru = shadow(capacity)
        self.share = share
        self.blocks = blocks
        self.retry_base = max(1, round(retry * self.lru.capacity))
        #: Blocks looked up to wait, in the floor, before the next retry.
        self.retry = self.retry_base
        #: LRU's prefix hits minus the cache's, and LRU's, since the start.
        self.deficit = 0
        self.lru_hits = 0
        #: The cache is plain LRU now (the policy is off).
        self.engaged = False
        self.low = 0.0  # the least X since the policy (re)started
        self.start = 0.0  # X when it (re)started
        self.seen = 0  # blocks looked up since the floor engaged
        #: How often the floor engaged, and the shadow's blocks missing from the cache at the last time.
        self.switches = 0
        self.missing = 0

    @property
    def excess(self) -> float:
        """``X``: the loss against LRU beyond ``share`` of its hits, since the start."""
        return self.deficit - self.share * self.lru_hits

    def step(self, digests: Sequence[bytes], matched: int, room: int | None = None) -> bool:
        """One lookup of ``digests``, of which the cache had the first ``matched``; ``room``: what
        LRU could hold now (None: the capacity). Returns True when the floor engaged or let go on
        it (the caller then changes the cache's priorities)."""
        hits = self.lru.replay(digests, room)
        self.deficit += hits - matched
        self.lru_hits += hits
        x = self.excess
        if self.engaged:
            self.seen += len(digests)
            if self.seen < self.retry:
                return False
            self.engaged = False
            self.low = self.start = x
            return True
        if x < self.low:
            self.low = x
            return False
        if x - self.low <= self.blocks:
            return False
        self.engaged = True
        self.switches += 1
        self.seen = 0
        self.retry = self.retry * 2 if x > self.start else self.retry_base
        return True

    def note_missing(self, cached: Container[bytes]) -> None:
        """Count the shadow's blocks the cache does not hold (``cached``: the pool's blocks by
        digest) — the most the switch just made can cost."""
        self.missing = self.lru.missing_from(cached)

    def describe(self) -> dict[str, object]:
        return {"engaged": self.engaged, "switches": self.switches, "deficit": self.deficit,
                "lru_hits": self.lru_hits, "excess": round(self.excess, 2), "retry_blocks": self.retry,
                "missing_at_switch": self.missing}
