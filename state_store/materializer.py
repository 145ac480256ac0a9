"""The materializer: Kafka (``kv-events``, ``node-stats``) to PostgreSQL, without faust.

Run it with ``kvflow materializer`` (more workers with the same group id share the partitions);
:mod:`state_store.faust_app` wires a :class:`Materializer` into faust's agents, timers and pages.

* ``kv-events``: messages are taken in batches, decoded strictly, planned
  (:mod:`state_store.apply`) and written in one transaction (:mod:`state_store.writer`) by the
  pipeline (:mod:`state_store.pipeline`). Offsets are acknowledged only after the transaction
  commits, so nothing is committed to Kafka before the database has it; a redelivered batch is
  recognized by ``nodes.last_event_id`` and changes nothing. Bad messages go to ``kv-events-dlq``
  with the reason in headers (and are counted); the ones around them are applied. A gap asks the
  node for a snapshot on ``kv-control``.
* ``node-stats``: heartbeats update ``nodes`` (identity, capacity, usage, load, counters) and
  append ``node_stats_samples``.
* Timers: liveness (``live`` → ``stale`` after missed heartbeats → ``gone`` after a grace, which
  clears the node's blocks); daily partitions of ``block_events`` and retention.
* PostgreSQL unavailable: the same transaction is retried with backoff, forever; consumption
  waits (faust's buffers fill and fetching pauses).
* ``/healthz`` (:meth:`Materializer.health`): 200 while the worker has Kafka partitions and the
  database answers, 503 with the reason otherwise; ``/metrics`` (Prometheus).

What the materializer sends (the DLQ, the control topic) goes through an :class:`Outbox`, so that
it runs in tests with fakes for the outbox and the writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import state_store.native
from eventbus.protocol import (
    ControlCommand,
    EventBatch,
    NodeId,
    NodeStats,
    ProtocolError,
    decode_batch,
    decode_stats,
    encode,
)
from state_store.config import MaterializerSettings
from state_store.metrics import Metrics
from state_store.pipeline import Ack, Decoded, EventsPipeline, KafkaMessage, PlanWriter, StreamEvent
from state_store.writer import TRANSIENT, Applied, with_retry

log = logging.getLogger("kvflow.materializer")
T = TypeVar("T")

#: A bad message too large for the DLQ is kept truncated to this size.
DLQ_TRUNCATE_BYTES = 512 * 1024
#: /healthz trusts a database round trip this recent (seconds) without asking the database again.
HEALTH_FRESH_S = 5.0
#: Longest /healthz waits for the database to answer ``SELECT 1`` (seconds).
HEALTH_PING_TIMEOUT_S = 1.0


class Outbox(Protocol):
    """Where the materializer sends messages (faust topics in a worker)."""

    async def send_dlq(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        """Put a message on the DLQ; returns once the broker has it.

        Raises:
            Exception: the DLQ did not take it (e.g. it is too large).
        """
        ...

    async def send_control(self, key: bytes, value: bytes) -> None:
        """Queue a command for the control topic (``kv-control``)."""
        ...


class StoreWriter(PlanWriter, Protocol):
    """The database side the materializer uses (:class:`state_store.writer.Writer`)."""

    async def apply(self, batches: Sequence[EventBatch]) -> Applied: ...
    async def apply_stats(self, stats: Sequence[NodeStats]) -> list[NodeId]: ...
    async def mark_liveness(self, stale_after_s: float, gone_after_s: float) -> list[NodeId]: ...
    async def prune_gone(self, after_s: float) -> list[NodeId]: ...
    async def repeat_resyncs(self, retry_s: float, retry_max_s: float) -> list[tuple[NodeId, int]]: ...
    async def run_maintenance(self, retention_days: float) -> None: ...
    async def reset_pool(self) -> None: ...
    async def ping(self, timeout_s: float = 1.0) -> None: ...


class Rejected(NamedTuple):
    """A message for the DLQ: the message, a short machine-readable reason, a human detail."""

    message: KafkaMessage
    reason: str
    detail: str


@dataclass(frozen=True)
class Health:
    """What ``/healthz`` answers."""

    ok: bool
    body: dict[str, Any]

    @property
    def status_code(self) -> int:
        return 200 if self.ok else 503


class Materializer:
    """One worker's materializer: decodes takes, runs the pipeline, keeps the metrics.

    Args:
        settings: ``KVFLOW_MATERIALIZER_…``.
        writer: the database side.
        outbox: the DLQ and the control topic.
    """

    def __init__(self, settings: MaterializerSettings, writer: StoreWriter, outbox: Outbox) -> None:
        self.settings = settings
        self.writer = writer
        self.outbox = outbox
        self.metrics = Metrics()
        self.db_ok = False
        self.last_commit = 0.0
        self._db_ok_at: float | None = None  # monotonic time of the last database round trip
        self._stale_caches_counted = 0  # of pipeline.stale_caches, in the metric
        native = settings.native and state_store.native.available()
        log.info("planning: %s", "compiled hot path (kvflow_native) and Python" if native else "Python")
        self.pipeline = EventsPipeline(writer, self, native=native, batch_max=settings.batch_max)

    # ------------------------------------------------------------------ kv-events

    def start(self, ack: Ack) -> None:
        """Start (or restart) the pipeline; ``ack`` acknowledges an event once it is written."""
        self.pipeline.start(ack)

    @staticmethod
    def decode(msg: KafkaMessage) -> EventBatch:
        """A kv-events message's batch.

        Raises:
            ProtocolError: it is not a valid batch, or its key is not its ``node_id``
                (reason ``key_mismatch``).
        """
        batch = decode_batch(msg.value or b"")
        if msg.key is not None and msg.key != batch.node_id.encode():
            raise ProtocolError("key_mismatch", f"message key {msg.key[:64]!r} is not node_id {batch.node_id!r}")
        return batch

    async def handle_events(self, events: Sequence[StreamEvent]) -> None:
        """A take of kv-events: the bad messages to the DLQ, the good ones to the pipeline (which
        acknowledges all of them once the good ones are written)."""
        good: list[Decoded] = []
        bad: list[Rejected] = []
        for i, e in enumerate(events):
            if i % 16 == 15:  # decoding is CPU work: let the previous take's COPY stream meanwhile
                await asyncio.sleep(0)
            msg = e.message
            try:
                good.append((msg, self.decode(msg)))
            except ProtocolError as exc:
                bad.append(Rejected(msg, exc.reason, exc.message))
        if bad:
            await self.to_dlq(bad)
        await self.pipeline.submit(good, events)

    async def slow_path(self, items: list[Decoded]) -> None:
        """Apply ``items`` planned inside the transaction from what the database holds; if the
        data cannot be applied at all, find the culprits one by one (DLQ ``apply_failed``)."""
        t0 = time.perf_counter()
        try:
            applied = await self.retrying(lambda: self.writer.apply([b for _, b in items]))
        except Exception as exc:  # not transient: retrying the same data fails the same way
            if len(items) > 1:
                log.error("transaction failed (%s); applying %d batches one by one", exc, len(items))
                for item in items:
                    await self.slow_path([item])
                return
            log.exception("batch could not be applied")
            await self.to_dlq([Rejected(items[0][0], "apply_failed", f"{type(exc).__name__}: {exc}")])
            return
        await self.committed(applied, time.perf_counter() - t0)

    async def committed(self, applied: Applied, seconds: float) -> None:
        """A take's transaction committed: its metrics, then the snapshots it calls for."""
        await self.ask_for_snapshots(self.record(applied, seconds))

    def record(self, applied: Applied, seconds: float) -> list[NodeId]:
        """Metrics of a committed transaction; returns the nodes to ask for a snapshot now."""
        m = self.metrics
        m.txn_seconds.observe(seconds)
        p = applied.plan
        m.takes.labels(p.planned_by()).inc()
        c = p.counts
        now = time.time()
        m.batches.inc(c.batches - c.duplicates - c.stale_replays)
        m.events.inc(c.events)
        m.block_events.inc(c.block_events)
        m.duplicates.inc(c.duplicates)
        m.stale.inc(c.stale_replays)
        m.gaps.inc(c.gaps)
        m.anomalies.inc(c.anomalies)
        for t in p.batch_ts:
            m.freshness.observe(max(0.0, now - t))
        m.last_commit.set(now)
        self.last_commit = now
        self._database_answered()
        return applied.resync_now

    async def ask_for_snapshots(self, nodes: Sequence[NodeId], reason: str = "event_id gap") -> None:
        """A ``resync`` command to each node on the control topic. It never raises: a command that
        cannot be sent is logged, and asked again while the node resyncs (:meth:`repeat_resyncs`),
        as is one the node never reads."""
        for node in nodes:
            self.metrics.resyncs.inc()
            log.info("asking %s for a snapshot (%s)", node, reason)
            cmd = ControlCommand(schema_version=1, node_id=node, command="resync", reason=reason, ts=time.time())
            try:
                await self.outbox.send_control(node.encode(), encode(cmd))
            except Exception as exc:  # whatever the producer says: the repeat asks again
                log.warning("could not send a resync command to %s (%s: %s); it is repeated while the node "
                            "resyncs", node, type(exc).__name__, exc)

    async def repeat_resyncs(self) -> None:
        """Ask again the nodes still ``resyncing`` long after their last snapshot request (the
        command may have been lost: a node's control listener reads only what is new), after a
        backoff that doubles with each request (``resync_retry_s`` … ``resync_retry_max_s``)."""
        s = self.settings
        try:
            due = await self.writer.repeat_resyncs(s.resync_retry_s, s.resync_retry_max_s)
        except TRANSIENT as exc:
            self._database_failed()
            log.debug("resync repeats skipped: %s", exc)
            return
        self._database_answered()
        for node, attempt in due:
            self.metrics.resync_repeats.inc()
            await self.ask_for_snapshots([node], f"still resyncing: request {attempt}")

    async def to_dlq(self, bad: Sequence[Rejected]) -> None:
        """Each bad message to the DLQ, delivered before the originals are acknowledged. It never
        raises: a message the DLQ cannot take whole goes truncated (with its size in a header)."""
        for msg, reason, detail in bad:
            self.metrics.dlq.labels(reason).inc()
            log.warning("DLQ %s[%s]@%s: %s: %s", msg.topic, msg.partition, msg.offset, reason, detail[:200])
            headers = [("kvflow-error-reason", reason.encode()), ("kvflow-error", detail[:1000].encode()),
                       ("kvflow-source-topic", str(msg.topic).encode()),
                       ("kvflow-source-partition", str(msg.partition).encode()),
                       ("kvflow-source-offset", str(msg.offset).encode())]
            value = msg.value or b""
            for attempt in range(2):
                try:
                    await self.outbox.send_dlq(msg.key, value, headers)
                    break
                except Exception as exc:  # e.g. larger than the DLQ accepts
                    if attempt == 1:
                        self.metrics.dlq.labels("dlq_send_failed").inc()
                        log.error("could not put %s[%s]@%s on the DLQ: %s", msg.topic, msg.partition, msg.offset,
                                  exc)
                        break
                    value = value[:DLQ_TRUNCATE_BYTES]
                    headers = [*headers, ("kvflow-truncated-from-bytes", str(len(msg.value or b"")).encode())]

    # ------------------------------------------------------------------ node-stats

    async def handle_stats(self, events: Sequence[StreamEvent]) -> None:
        """A take of node-stats: the bad messages to the DLQ, the heartbeats into the database
        (the caller acknowledges the take afterwards)."""
        good: list[NodeStats] = []
        bad: list[Rejected] = []
        for e in events:
            try:
                good.append(decode_stats(e.message.value or b""))
            except ProtocolError as exc:
                bad.append(Rejected(e.message, exc.reason, exc.message))
        if bad:
            await self.to_dlq(bad)
        if good:
            gone = await self.retrying(lambda: self.writer.apply_stats(good))
            self.metrics.stats.inc(len(good))
            if gone:
                self.metrics.goodbyes.inc(len(gone))
                log.info("%s said goodbye: gone, blocks cleared", ", ".join(gone))
                self._forget_nodes()

    # ------------------------------------------------------------------ the database

    async def retrying(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()``, retried with backoff (forever) while the database is unavailable."""
        result = await with_retry(fn, on_retry=self._on_retry, reconnect=self.writer.reset_pool)
        self._database_answered()
        return result

    def _on_retry(self, exc: BaseException, delay: float) -> None:
        self.metrics.db_retries.inc()
        self._database_failed()
        log.warning("database unavailable (%s: %s); retrying in ~%.1f s", type(exc).__name__, exc, delay)

    def _database_answered(self) -> None:
        self.db_ok = True
        self._db_ok_at = time.monotonic()

    def _database_failed(self) -> None:
        self.db_ok = False
        self._db_ok_at = None

    async def liveness(self) -> None:
        """Mark silent nodes stale, and long-stale ones gone (their blocks cleared); delete the
        rows of nodes gone for ``prune_gone_after_s`` (their history stays)."""
        s = self.settings
        try:
            gone = await self.writer.mark_liveness(s.stale_after_s, s.gone_after_s)
            pruned = await self.writer.prune_gone(s.prune_gone_after_s) if s.prune_gone_after_s > 0 else []
        except TRANSIENT as exc:
            self._database_failed()
            log.debug("liveness check skipped: %s", exc)
            return
        self._database_answered()
        for node in gone:
            log.info("node %s is gone: its blocks were cleared", node)
        if pruned:
            self.metrics.pruned.inc(len(pruned))
            log.info("pruned %s: gone for %.0f s (history kept)", ", ".join(pruned), s.prune_gone_after_s)
        if gone or pruned:
            self._forget_nodes()

    def _forget_nodes(self) -> None:
        """Nodes changed under the worker's cache (gone: blocks cleared; pruned: no row): drop it,
        so that their next batches are planned from the database. (Rare; a plan already made
        from the old cache is caught by the writer's check, ``Writer.apply_planned``.)"""
        self.pipeline.planner.invalidate()

    async def maintenance(self) -> None:
        """Partitions of ``block_events`` ahead, and retention."""
        try:
            await self.writer.run_maintenance(self.settings.retention_days)
        except TRANSIENT as exc:
            log.warning("maintenance skipped: %s", exc)

    # ------------------------------------------------------------------ web

    async def health(self, partitions_assigned: int, group_member: bool = False) -> Health:
        """``/healthz``: healthy while the worker has Kafka partitions assigned, or is a member of
        its consumer group with none (a *standby*: more workers than partitions; it takes over
        when a rebalance gives it some), and the database answers (a round trip within
        :data:`HEALTH_FRESH_S`, or ``SELECT 1`` now).

        Args:
            partitions_assigned: the partitions the worker's consumer has now (faust:
                ``len(app.consumer.assignment())``).
            group_member: the consumer is in its group now (a generation of its own; faust:
                :func:`state_store.faust_compat.group_generation` ≥ 0), not joining it.
        """
        reasons: list[str] = []
        if partitions_assigned <= 0 and not group_member:
            reasons.append("not in its consumer group yet: joining, or rejoining after the group dropped it")
        fresh = self._db_ok_at is not None and time.monotonic() - self._db_ok_at < HEALTH_FRESH_S
        database_error = None if fresh else await self._ping()
        if database_error is not None:
            reasons.append(f"database unreachable ({database_error})")
        status = "unavailable" if reasons else "ok" if partitions_assigned > 0 else "standby"
        body = {"status": status, "db_ok": database_error is None,
                "last_commit": self.last_commit, "group_id": self.settings.group_id,
                "partitions_assigned": partitions_assigned, "group_member": group_member,
                "reason": "; ".join(reasons) or None}
        return Health(not reasons, body)

    async def _ping(self) -> str | None:
        """None if the database answers ``SELECT 1`` now, else why not."""
        try:
            await self.writer.ping(HEALTH_PING_TIMEOUT_S)
        except Exception as exc:  # whatever it is, the database did not answer
            self._database_failed()
            return f"{type(exc).__name__}: {exc}"[:300]
        self._database_answered()
        return None

    def partitions_revoked(self, revoked: int) -> None:
        """A rebalance took ``revoked`` partitions from this worker (faust calls this once the
        takes of its partitions were written). Another worker writes their nodes now, so the
        cache of them is dropped: the plans made from it before (the assignment's generation)
        are never written as planned, and the next takes load what the database holds."""
        if revoked <= 0:
            return
        log.info("rebalance: %d partitions revoked; dropping the cache of their nodes", revoked)
        self.metrics.revocations.inc()
        self.pipeline.planner.invalidate()

    def metrics_text(self) -> bytes:
        """``/metrics``: Prometheus' text format."""
        stale = self.pipeline.stale_caches
        self.metrics.stale_caches.inc(stale - self._stale_caches_counted)
        self._stale_caches_counted = stale
        return self.metrics.exposition()
