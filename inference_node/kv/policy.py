"""Eviction policies: which evictable block goes next, and at what priority blocks are kept.

The :class:`~inference_node.kv.pool.BlockPool` is mechanical: slots, the digest map, the tiers,
the ``stored`` / ``removed`` / tier events. Everything that *decides* lives behind
:class:`EvictionPolicy`, the one interface between them (vLLM's lesson: its ``BlockPool`` keeps a
``FreeKVCacheBlockQueue`` and a policy could order it):

* **which block goes next** — the policy keeps each tier's free-block order (``orders``: an
  :class:`~inference_node.kv.eviction.EvictionIndex` per tier), hands out victims
  (:meth:`~EvictionPolicy.victims`, :meth:`~EvictionPolicy.victim`) and may act just before an
  eviction (:meth:`~EvictionPolicy.before_eviction`);
* **what happened** — the pool tells it: blocks freed (:meth:`~EvictionPolicy.release`: no request
  uses them any more), reused (taken into use: the order's ``discard`` / ``pin_listed``, and
  :meth:`~EvictionPolicy.lookup`), moved (a priority changed: :meth:`~EvictionPolicy.set_priority`;
  a tier changed: the order's ``add``/``unpark``), evicted (:meth:`~EvictionPolicy.evicted`), and
  admissions that failed (:meth:`~EvictionPolicy.given_back`);
* **retention** — the priority and duration of the blocks of requests that bring no retention
  config (:meth:`~EvictionPolicy.prompt_retention`, :meth:`~EvictionPolicy.new_block`,
  :meth:`~EvictionPolicy.reused`), and the retention clocks: a duration that runs out drops its
  block to the default priority (:meth:`~EvictionPolicy.expire`).

Two implementations:

* :class:`PriorityRetention` — TensorRT-LLM's ``KvCacheRetentionConfig`` semantics, kvflow's
  contract (docs/architecture.md#retention-and-eviction): lowest priority first, least
  recently used first within a priority, leaves only; durations fall back to 35; a request
  without a retention config leaves priorities alone and stores at 35.
* :class:`~inference_node.kv.adaptive_eviction.AdaptiveEviction` — the same order and clocks,
  plus priorities learned online for requests without hints (:mod:`inference_node.kv.adaptive`).

What the order needs of a block is only an id for ties (``uid``), a priority, a use order
(``last_used``, from the policy's tick), an in-use count (``ref``), the order's own two slots
(``evict_state``, ``heap_version``), a retention duration and its clock's version
(``duration``, ``expiry_version``), and, for the leaf rule, the counts of cached children
(``children``, ``gpu_children``, ``parent``): an engine that keeps no prefix tree (vLLM) gives
every block 0 children and no parent, and the order is then plain priority + LRU with expiries.
Any object with those slots can be ordered (:class:`~inference_node.kv.block.Block` is kvflow's).

Priority changes the policy makes on its own (an expiry, the adaptive policy's demotions and
revokes) are ``updated`` events through the pool's :class:`~eventbus.events.EventLog`, as every
change of the cache is.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from eventbus.events import EventLog
from eventbus.protocol import DEFAULT_PRIORITY, GPU, HOST, BlockDigest, PriorityDiff, Updated
from inference_node.kv.block import Block
from inference_node.kv.clock import Clock
from inference_node.kv.eviction import EvictionIndex
from inference_node.kv.types import KvStats

#: Priority, retention duration (None: never expires) and adaptive class (-1: none) of a block.
Retention = tuple[int, float | None, int]
#: The retention of each new block of a prompt, from its first unmatched one.
Retentions = Sequence[Retention]
_DEFAULT: Retention = (DEFAULT_PRIORITY, None, -1)


class EvictionPolicy:
    """The interface between the block pool and what decides (see the module docstring).

    The base class is :class:`PriorityRetention`'s mechanism: every policy keeps the same
    free-block order and retention clocks, and overrides the decisions and the notifications it
    learns from. A policy serves one cache: the pool calls :meth:`attach` once.
    """

    #: The policy's name (``/v1/kv/stats``, the benchmarks).
    name = "priority"

    def __init__(self) -> None:
        #: The free-block order of each tier (GPU, host): evictable blocks, lowest priority
        #: first, least recently used first within a priority, leaves only. The pool tells them
        #: what it does to blocks (``discard`` when it takes one into use, ``add`` when one
        #: enters a tier, ``unpark`` when a parent loses a child, ``pin_listed``).
        self.orders = (EvictionIndex(GPU), EvictionIndex(HOST))
        #: Retention clocks: a heap of (deadline, uid, expiry_version, block) with lazy deletion
        #: (read it, e.g. to skip calling :meth:`expire` when it is empty).
        self.expiries: list[tuple[float, int, int, Block]] = []
        #: Blocks a release made evictable whose clocks start (reused).
        self._clocks: list[Block] = []
        self._tick = 0
        # What attach() gives (placeholders until then).
        self._clock: Clock = lambda: 0.0
        self._stats = KvStats()
        self._events = EventLog(window_size=0, max_queued=1, snapshot_part_blocks=1, stats=self._stats)
        self._cached: dict[BlockDigest, Block] = {}

    def attach(self, clock: Clock, events: EventLog, stats: KvStats, cached: dict[BlockDigest, Block]) -> None:
        """Serve one cache: its clock, event log, counters and cached blocks (read only)."""
        self._clock = clock
        self._events = events
        self._stats = stats
        self._cached = cached

    @property
    def tick(self) -> int:
        """The last release tick handed out (``Block.last_used`` counts in it)."""
        return self._tick

    @property
    def learner(self) -> object | None:
        """What the policy learned (None: it learns nothing)."""
        return None

    def describe(self) -> dict[str, object] | None:
        """The learned state for ``/v1/kv/stats`` (None: nothing learned)."""
        return None

    # ------------------------------------------------------------------ what happened

    def release(self, blocks: Iterable[Block], level: int, freed: list[int]) -> None:
        """``blocks`` of ``level``, in release order (a request's tail first), lose a user: each
        that no request uses any more becomes evictable, the newest of all, and its retention
        clock starts; private blocks' slots go to ``freed``."""
        first = self._tick + 1
        clocks = self._clocks
        self._tick = self.orders[level].release(blocks, self._tick, freed, clocks)
        if clocks:
            now = self._clock()
            push, heap = heapq.heappush, self.expiries
            for b in clocks:
                b.expiry_version += 1
                push(heap, (now + b.duration, b.uid, b.expiry_version, b))  # type: ignore[operator]
            clocks.clear()
        if self._tick >= first:
            self._released(level, first)

    def _released(self, level: int, first_tick: int) -> None:
        """A release made blocks of ``level`` evictable, with ``last_used`` from ``first_tick``
        on (the order counts them per priority in ``arrived``)."""

    def given_back(self, b: Block) -> None:
        """``b`` was taken into use by an admission that failed and is released unused."""

    def evicted(self, victims: Sequence[Block], runs: Sequence[Sequence[Block]] | None = None) -> None:
        """``victims`` leave the cache (their digests still set); ``runs``: the same blocks as
        :meth:`victims` handed them out."""

    def set_priority(self, b: Block, priority: int, duration: float | None) -> None:
        """A request's retention for ``b`` (in use): its duration, and its priority (``updated``
        when it changes)."""
        b.duration = duration
        if priority != b.priority:
            old = b.priority
            self.orders[b.level].rekey(b, priority)
            self._stats.reprioritizations += 1
            self._updated(b, old, priority)

    def expire(self) -> None:
        """Retention durations that ran out by now: their blocks fall back to the default
        priority (``updated``)."""
        heap = self.expiries
        if not heap:
            return
        now = self._clock()
        while heap and heap[0][0] <= now:
            _, _, version, b = heapq.heappop(heap)
            if version != b.expiry_version or b.digest is None:
                continue
            b.duration = None
            self._stats.expirations += 1
            if b.priority != DEFAULT_PRIORITY:
                old = b.priority
                self.orders[b.level].rekey(b, DEFAULT_PRIORITY)
                if not b.ref:
                    self._moved(b, old)
                self._updated(b, old, DEFAULT_PRIORITY)

    def _moved(self, b: Block, old: int) -> None:
        """An evictable block changed priority from ``old`` to ``b.priority`` where it stands."""

    def _updated(self, b: Block, old: int, new: int) -> None:
        self._events.emit(Updated(block_hash=b.hash, priority=PriorityDiff(old=old, new=new)))

    # ------------------------------------------------------------------ which block goes next

    def before_eviction(self, k: int) -> None:
        """``k`` GPU blocks are about to be evicted (the free list is empty)."""

    def victims(self, k: int) -> list[Block]:
        """Up to ``k`` GPU victims, in eviction order (:meth:`EvictionIndex.take`); empty when
        nothing is evictable."""
        return self.orders[GPU].take(k)

    def victim(self, level: int) -> Block | None:
        """The next victim of ``level`` (None: nothing is evictable there)."""
        return self.orders[level].pop()

    # ------------------------------------------------------------------ requests without retention

    def held(self, slots: int) -> None:
        """Before a :meth:`lookup`: the slots other requests hold now with no cached block in them
        (their unfinished blocks)."""

    def lookup(self, digests: Sequence[BlockDigest], blocks: Sequence[Block]) -> None:
        """A prompt of ``digests`` was looked up; ``blocks``, its cached prefix, are now in use
        (called before its new blocks are stored)."""

    def reused(self, blocks: Sequence[Block]) -> None:
        """A request without a retention config reuses ``blocks`` (after :meth:`lookup`)."""

    def prompt_retention(self, prompt_blocks: int, matched: int, end: int) -> Retentions | None:
        """The retention of a prompt's new full blocks ``matched..end-1`` when its request brings
        none (after :meth:`lookup`); None: the default priority, no duration."""
        return None

    def new_block(self, index: int, prompt_blocks: int, matched: int, is_decode: bool) -> Retention:
        """The retention of one new block (generated tokens) of a request without a config."""
        return _DEFAULT

    def generated(self, digest: BlockDigest) -> None:
        """A block a running request filled was cached under ``digest`` (no lookup brought it)."""


class PriorityRetention(EvictionPolicy):
    """TensorRT-LLM's priority + retention, kvflow's contract: clients' priorities and
    durations; blocks of requests without a config at 35; reuse without a config changes
    nothing. (The base class's behaviour, named.)"""

    name = "priority"
