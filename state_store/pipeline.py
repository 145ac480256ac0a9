"""The materializer's event path: decoded takes of ``kv-events`` → plans → transactions → acks.

:class:`EventsPipeline` runs two stages, so that Python and PostgreSQL work at the same time;
:class:`TakePlanner` plans a take against the worker's :class:`~state_store.apply.NodeCache`
(with the compiled hot path where it can). What the pipeline needs of the rest of the worker
(retries, the slow path, what to do after a commit) is :class:`PipelineHooks`, which
:class:`state_store.materializer.Materializer` implements; no faust here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import state_store.native
from eventbus.protocol import Created, EventBatch, NodeId, Snapshot
from state_store.apply import NodeCache, Planner
from state_store.plans import BlockRow, CompiledPlan, Expected, NodeRow, PartsPlan, Plan, RowsPlan
from state_store.writer import Applied, StaleCache

log = logging.getLogger("kvflow.materializer")
T = TypeVar("T")

#: Events that restart a node's state: only the reference planner plans them.
_RESTARTS = (Created, Snapshot)


class KafkaMessage(Protocol):
    """What the materializer reads of a consumed Kafka message (faust's ``Message``)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...


class StreamEvent(Protocol):
    """A consumed event of a stream (faust's ``Event``): its message."""

    @property
    def message(self) -> KafkaMessage: ...


#: A good message of a take and its decoded batch.
Decoded = tuple[KafkaMessage, EventBatch]
#: Acknowledges an event (faust's ``Stream.ack``): its offset may be committed.
Ack = Callable[[StreamEvent], Awaitable[object]]


class PlanWriter(Protocol):
    """The database side the pipeline uses (:class:`state_store.writer.Writer`)."""

    async def load(self, node_ids: Sequence[NodeId]) -> tuple[list[NodeRow], list[BlockRow]]: ...
    async def apply_planned(self, p: Plan, expected: Expected) -> Applied: ...


class PipelineHooks(Protocol):
    """What the pipeline asks of the worker around it."""

    async def retrying(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()``, retried with backoff while the database is unavailable."""
        ...

    async def slow_path(self, items: list[Decoded]) -> None:
        """Apply ``items`` planned from what the database holds (never raises)."""
        ...

    async def committed(self, applied: Applied, seconds: float) -> None:
        """A take's transaction committed in ``seconds``."""
        ...


class TakePlanner:
    """Plans takes against the worker's cache of its nodes' rows.

    ``generation`` counts the times the cache was dropped (:meth:`invalidate`): a plan made in an
    older generation is never written.
    """

    def __init__(self, native: bool = False) -> None:
        self.cache: NodeCache = state_store.native.NativeNodeCache() if native else NodeCache()
        self.generation = 0

    def invalidate(self) -> None:
        """Drop the cache (the database is not where it said, or a take failed)."""
        self.generation += 1
        self.cache.clear()

    async def plan(self, batches: list[EventBatch], gen: int) -> Plan | None:
        """The take's plan, applied to the cache (None: the cache was dropped meanwhile, and the
        take goes the slow path). Only one coroutine plans at a time.

        With the compiled hot path the take is planned in up to three parts, written in order:
        1. the reference planner: each node's batches up to its last ``created`` or ``snapshot``
           event (which only it plans), so that the hot path takes over right after a node starts
           or resyncs;
        2. the hot path: every other batch of every node it can plan;
        3. the reference planner: the rest of the nodes the hot path could not plan (found one at
           a time: the hot path plans again without each).

        NOTE: planning is CPU work in the event loop; yielding every 16 batches lets the previous
        take's transaction stream its COPY meanwhile."""
        cache = self.cache
        if not isinstance(cache, state_store.native.NativeNodeCache):
            return await self._plan_python(batches, gen)
        last_restart: dict[str, int] = {}
        for i, b in enumerate(batches):
            if any(type(e.data) in _RESTARTS for e in b.events):
                last_restart[b.node_id] = i
        head = [b for i, b in enumerate(batches) if i <= last_restart.get(b.node_id, -1)]
        tail = [b for i, b in enumerate(batches) if i > last_restart.get(b.node_id, -1)]
        parts: list[RowsPlan | CompiledPlan] = []
        if head and (part := await self._plan_python(head, gen)) is not None:
            parts.append(part)
        excluded: set[NodeId] = set()
        while tail and gen == self.generation:
            fast = cache.fast_planner()
            for i, b in enumerate(tail):
                if b.node_id in excluded:
                    continue
                if not fast.add(b):
                    fast.abort()
                    excluded.add(b.node_id)
                    break
                if i % 16 == 15:
                    await asyncio.sleep(0)
                    if gen != self.generation:  # the store was cleared under the planner
                        return None
            else:
                compiled = fast.finish()
                cache.apply(compiled)
                if compiled.counts.batches:
                    parts.append(compiled)
                break
        rest = [b for b in tail if b.node_id in excluded]
        if rest and (part := await self._plan_python(rest, gen)) is not None:
            parts.append(part)
        if gen != self.generation:
            return None
        return PartsPlan.of(parts)

    async def _plan_python(self, batches: list[EventBatch], gen: int) -> RowsPlan | None:
        planner = Planner(self.cache.nodes, self.cache)
        for i, b in enumerate(batches):
            planner.add(b)
            if i % 16 == 15:
                await asyncio.sleep(0)
        if gen != self.generation:
            return None
        p = planner.finish()
        self.cache.apply(p)
        return p


@dataclass
class _Item:
    items: list[Decoded]
    events: list[StreamEvent]  # to acknowledge once committed
    plan: Plan | None
    expected: Expected
    generation: int


class EventsPipeline:
    """Two stages, so that Python and PostgreSQL work at the same time.

    The agent hands each take of decoded batches to :meth:`submit`, which only queues it.
    Stage 1 (:meth:`_plan_loop`, a task) plans what has arrived against the worker's
    :class:`~state_store.apply.NodeCache`; stage 2 (:meth:`_write_loop`, a task) writes the plans in
    order, each in one transaction that first checks the database is where the cache said, then
    acknowledges the take's messages. At most ``depth`` plans are planned and not yet written;
    meanwhile the arriving takes wait, and the next plan takes all of them (up to about
    ``batch_max`` messages): when the database is the bottleneck, transactions grow, and a block
    stored and removed within one never touches ``node_blocks``. Beyond ``2 * batch_max`` waiting
    messages the agent waits too (Kafka consumption pauses).

    If the database is not where the cache said (another worker wrote these nodes, e.g. during a
    rebalance) or a transaction fails on its data, the cache is dropped and the queued takes go
    the slow path (:meth:`PipelineHooks.slow_path`): planned inside their transaction from what
    the database holds.

    Args:
        writer: the database side.
        hooks: retries, the slow path and what follows a commit.
        depth: plans made and not yet written, at most.
        native: plan with the compiled hot path (``kvflow_native`` must be installed).
        batch_max: messages per plan, about.
    """

    def __init__(self, writer: PlanWriter, hooks: PipelineHooks, *, depth: int = 2, native: bool = False,
                 batch_max: int = 2000) -> None:
        self.writer = writer
        self.hooks = hooks
        self.batch_max = batch_max
        self.planner = TakePlanner(native)
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.slots = asyncio.Semaphore(depth)
        self.pending: collections.deque[tuple[list[Decoded], list[StreamEvent]]] = collections.deque()
        self.pending_messages = 0
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self.stale_caches = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._ack: Ack | None = None

    def start(self, ack: Ack) -> None:
        """Start (or restart, after the agent restarted) the two stages."""
        self._ack = ack
        loops = (self._plan_loop, self._write_loop)
        if not self._tasks:
            self._tasks = [asyncio.ensure_future(loop()) for loop in loops]
        for i, loop in enumerate(loops):
            if self._tasks[i].done():
                self._tasks[i] = asyncio.ensure_future(loop())

    async def stop(self) -> None:
        """Cancel the two stages (what is queued stays unacknowledged)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def submit(self, items: list[Decoded], events: Sequence[StreamEvent]) -> None:
        """Queue a take (its good batches; all its events, acknowledged once written)."""
        self.pending.append((items, list(events)))
        self.pending_messages += len(events)
        self._arrived.set()
        while self.pending_messages > 2 * self.batch_max:
            self._room.clear()
            await self._room.wait()

    async def _plan_loop(self) -> None:
        while True:
            await self.slots.acquire()  # released once a plan is written
            while not self.pending:
                self._arrived.clear()
                await self._arrived.wait()
            items: list[Decoded] = []
            events: list[StreamEvent] = []
            while self.pending and len(events) < self.batch_max:
                i, e = self.pending.popleft()
                items += i
                events += e
            self.pending_messages -= len(events)
            self._room.set()
            try:
                item = await self._prepare(items, events)
            except asyncio.CancelledError:
                raise
            except Exception:  # never lose the loop: the slow path plans it from the database
                log.exception("planning a take failed; dropping the cache")
                self.planner.invalidate()
                item = _Item(items, events, None, {}, self.planner.generation)
            self.queue.put_nowait(item)

    async def _prepare(self, items: list[Decoded], events: list[StreamEvent]) -> _Item:
        planner = self.planner
        gen = planner.generation
        p: Plan | None = None
        expected: Expected = {}
        if items:
            batches = [b for _, b in items]
            node_ids = {b.node_id for b in batches}
            missing = planner.cache.missing(node_ids)
            if missing:
                nodes, blocks = await self.hooks.retrying(lambda: self.writer.load(missing))
                if gen == planner.generation:
                    planner.cache.load(nodes, blocks, missing)
            if gen == planner.generation:
                expected = planner.cache.expected(node_ids)
                p = await planner.plan(batches, gen)
        return _Item(items, events, p, expected, gen)

    async def _write_loop(self) -> None:
        while True:
            item = await self.queue.get()
            try:
                await self._write(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # never lose the loop; the messages stay unacknowledged
                log.exception("writing a take failed; dropping the cache and retrying it")
                self.planner.invalidate()
                await self.hooks.slow_path(item.items)
            try:
                assert self._ack is not None  # start() came first
                for e in item.events:
                    await self._ack(e)
            finally:
                self.slots.release()

    async def _write(self, item: _Item) -> None:
        if not item.items:
            return
        planned = item.plan
        if planned is None or item.generation != self.planner.generation:
            await self.hooks.slow_path(item.items)
            return
        t0 = time.perf_counter()
        try:
            applied = await self.hooks.retrying(lambda: self.writer.apply_planned(planned, item.expected))
        except StaleCache as exc:
            self.stale_caches += 1
            log.info("cache out of date (%s): replanning from the database", exc)
            self.planner.invalidate()
            await self.hooks.slow_path(item.items)
            return
        except Exception as exc:  # the data cannot be applied as planned: slow path isolates it
            log.error("planned transaction failed (%s: %s); replanning from the database", type(exc).__name__, exc)
            self.planner.invalidate()
            await self.hooks.slow_path(item.items)
            return
        await self.hooks.committed(applied, time.perf_counter() - t0)
