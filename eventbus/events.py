"""The producer's bounded event log: every change of a cache's block set, queued until a publisher
drains it (docs/architecture.md#eventbatch: ``event_id`` +1 per event, no gap a consumer cannot see).

Every producer of ``kv-events`` numbers, coalesces and bounds its events here: the KV core of a
kvflow node (``inference_node.kv``) and a bridge's translator of a real engine's events
(``bridge.translate``).

* **Ids.** Events are numbered from 0 per cache instance, +1 each.
* **Removals coalesce.** Consecutive removals within one eviction of the core (all the victims
  one request needs) share one ``removed`` event (up to
  :data:`~eventbus.protocol.EVENT_BLOCKS_CHUNK` hashes, then another): :meth:`EventLog.removed`
  is the one place that does it. Any other event, and the end of the eviction
  (:meth:`EventLog.close_removed`), closes the open one.
* **Bounded.** Beyond ``max_queued`` events the queue overflows: what is queued is dropped
  (never delivered, so its ids are reused), the drops are counted, and the log owes the consumer
  a ``snapshot`` (:attr:`EventLog.snapshot_due`), which the core emits at the next drain.
* **Snapshots** are queued even past the bound: they replace what overflowed, and refusing them
  would only owe the consumer another one. A cache larger than ``snapshot_part_blocks`` goes in
  several parts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from eventbus.protocol import EVENT_BLOCKS_CHUNK, BlockHash, Event, EventData, Removed, Snapshot, SnapshotBlock


class EventCounters(Protocol):
    """Where an :class:`EventLog` counts what it did (the KV core's ``KvStats`` is one)."""

    events_emitted: int
    events_overflowed: int
    snapshots: int


@dataclass
class EventLogStats:
    """The counters of an :class:`EventLog` whose producer keeps no others (a bridge)."""

    events_emitted: int = 0
    events_overflowed: int = 0
    snapshots: int = 0


class EventLog:
    """The queue of one cache's events (see the module docstring)."""

    __slots__ = ("_events", "_max", "_next_id", "_open_removed", "_overflowed", "_part_blocks", "_stats",
                 "_window_size", "snapshot_requested")

    def __init__(self, *, window_size: int, max_queued: int, snapshot_part_blocks: int,
                 stats: EventCounters) -> None:
        self._events: deque[Event] = deque()
        self._window_size = window_size
        self._max = max_queued
        self._part_blocks = snapshot_part_blocks
        self._stats = stats  # events_emitted, events_overflowed, snapshots are counted there
        self._next_id = 0
        self._overflowed = False
        self._open_removed: list[BlockHash] | None = None
        #: A consumer asked for a snapshot (``KVCacheManager.request_snapshot``).
        self.snapshot_requested = False

    @property
    def last_event_id(self) -> int:
        """The id of the last event emitted (-1 before any)."""
        return self._next_id - 1

    @property
    def pending(self) -> int:
        return len(self._events)

    @property
    def snapshot_due(self) -> bool:
        """The next drain must start with a snapshot (the queue overflowed, or one was asked for)."""
        return self._overflowed or self.snapshot_requested

    def emit(self, data: EventData) -> None:
        """Queue one event (it closes the open ``removed`` event)."""
        self._open_removed = None
        if self._overflowed:
            self._stats.events_overflowed += 1
            return
        q = self._events
        if len(q) >= self._max:
            # Overflow: drop what is queued (never delivered, so its ids are reused) and owe the
            # consumer a snapshot at the next drain.
            self._stats.events_overflowed += len(q) + 1
            self._next_id = q[0].event_id
            q.clear()
            self._overflowed = True
            return
        q.append(Event(self._next_id, self._window_size, data))  # type: ignore[arg-type]  # NOTE: no NewType call per event
        self._next_id += 1
        self._stats.events_emitted += 1

    def removed(self, hashes: Sequence[BlockHash], *, close: bool = False) -> None:
        """Blocks left the cache: their hashes join the open ``removed`` event while it has room,
        then go into new ones; the last stays open for more unless ``close``."""
        i = 0
        n = len(hashes)
        open_ = self._open_removed
        if open_ is not None:
            i = min(n, EVENT_BLOCKS_CHUNK - len(open_))
            open_ += hashes[:i]
        while i < n:
            chunk = list(hashes[i:i + EVENT_BLOCKS_CHUNK])  # a copy: the caller may reuse ``hashes``
            self.emit(Removed(block_hashes=chunk))
            # NOTE: the queued event holds this very list, so later removals extend it in place (if
            # the event was dropped by an overflow, they extend a list nobody reads: harmless).
            open_ = chunk
            i += EVENT_BLOCKS_CHUNK
        self._open_removed = None if close else open_

    def close_removed(self) -> None:
        """An eviction ended: later removals start a new ``removed`` event."""
        self._open_removed = None

    def snapshot(self, blocks: list[SnapshotBlock]) -> None:
        """The whole cache, parents first, in parts of at most ``snapshot_part_blocks`` blocks (one
        part when it fits); it settles what :attr:`snapshot_due` owed."""
        self._overflowed = False
        self.snapshot_requested = False
        self._stats.snapshots += 1
        step = self._part_blocks
        parts = max(1, -(-len(blocks) // step))
        q = self._events
        for part in range(parts):
            q.append(Event(self._next_id, self._window_size,  # type: ignore[arg-type]
                           Snapshot(blocks=blocks[part * step:(part + 1) * step], part=part, parts=parts)))
            self._next_id += 1
            self._stats.events_emitted += 1
        self._open_removed = None

    def drain(self, max_events: int | None = None) -> list[Event]:
        """Take queued events, oldest first (the caller emits a due snapshot first)."""
        q = self._events
        if max_events is None or max_events >= len(q):
            out = list(q)
            q.clear()
        else:
            out = [q.popleft() for _ in range(max_events)]
        self._open_removed = None
        return out
