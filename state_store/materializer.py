"""The materializer: a faust-streaming app from Kafka (``kv-events``, ``node-stats``) to PostgreSQL.

Run it with ``kvflow materializer`` (more workers with the same group id share the partitions).

* ``kv-events``: messages are taken in batches (``noack_take``), decoded strictly, planned
  (:mod:`state_store.apply`) and written in one transaction (:mod:`state_store.writer`). Offsets
  are acknowledged only after the transaction commits, so nothing is committed to Kafka before
  the database has it; a redelivered batch is recognized by ``nodes.last_event_id`` and changes
  nothing. Bad messages go to ``kv-events-dlq`` with the reason in headers (and are counted); the
  ones around them are applied. A gap asks the node for a snapshot on ``kv-control``.
* ``node-stats``: heartbeats update ``nodes`` (identity, capacity, usage, load, counters) and
  append ``node_stats_samples``.
* Timers: liveness (``live`` → ``stale`` after missed heartbeats → ``gone`` after a grace, which
  clears the node's blocks); daily partitions of ``block_events`` and retention.
* PostgreSQL unavailable: the same transaction is retried with backoff, forever; consumption
  waits (faust's buffers fill and fetching pauses).
* Web (faust's): ``/healthz`` and ``/metrics`` (Prometheus) on ``KVFLOW_MATERIALIZER_WEB_PORT``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import logging
import ssl
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiokafka
import faust
from faust.transport.drivers import aiokafka as faust_aiokafka
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

import state_store.native
from eventbus.config import Environment, KafkaSecurityProtocol, KafkaSettings, RuntimeSettings
from eventbus.protocol import (
    ControlCommand,
    Created,
    EventBatch,
    NodeStats,
    ProtocolError,
    Snapshot,
    decode_batch,
    decode_stats,
    encode,
)
from state_store.apply import NodeCache, Plan, Planner
from state_store.config import DatabaseSettings
from state_store.writer import TRANSIENT, Applied, StaleCache, Writer, with_retry

log = logging.getLogger("kvflow.materializer")
#: Events that restart a node's state: only the reference planner plans them.
_RESTARTS = (Created, Snapshot)
#: A bad message too large for the DLQ is kept truncated to this size.
DLQ_TRUNCATE_BYTES = 512 * 1024


class MaterializerSettings(BaseSettings):
    """``KVFLOW_MATERIALIZER_…``"""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_MATERIALIZER_", extra="ignore")

    group_id: str = Field(default="kvflow-materializer", description="Kafka consumer group (and faust app id).")
    batch_max: int = Field(default=2000, ge=1, description="Messages per transaction at most.")
    batch_within_s: float = Field(default=0.05, gt=0, description="Longest wait to fill a batch.")
    stale_after_s: float = Field(default=6.0, gt=0, description="No heartbeat or event for this long: stale.")
    gone_after_s: float = Field(default=60.0, gt=0, description="Stale this long: gone, its blocks cleared.")
    retention_days: float = Field(default=7.0, gt=0, description="History kept in block_events.")
    resync_cooldown_s: float = Field(default=5.0, ge=0, description="Ask a node for a snapshot at most this often.")
    web_host: str = Field(default="127.0.0.1", description="Bind address of /healthz and /metrics.")
    web_port: int = Field(default=6066, description="Port of /healthz and /metrics (0: no web server).")
    pool_size: int = Field(default=2, ge=1, description="Database connections.")
    datadir: str | None = Field(default=None, description="faust's data folder (no tables are kept there).")
    session_timeout_s: float = Field(default=10.0, description="Kafka group session timeout.")
    fetch_max_wait_ms: int = Field(default=100, ge=1, le=1500,
                                   description="Longest a fetch waits at the broker for partitions without new data.")
    native: bool = Field(default=True, description="Plan plain takes with the compiled hot path when kvflow_native "
                                                   "is installed (state_store/native.py).")


class Metrics:
    """Prometheus metrics of one materializer (own registry: several apps may share a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.batches = Counter("kvflow_materializer_batches_total", "EventBatches applied", registry=r)
        self.events = Counter("kvflow_materializer_events_total", "Events applied", registry=r)
        self.block_events = Counter("kvflow_materializer_block_events_total", "block_events rows written",
                                    registry=r)
        self.duplicates = Counter("kvflow_materializer_duplicate_batches_total",
                                  "Redelivered batches recognized and skipped", registry=r)
        self.stale = Counter("kvflow_materializer_stale_replays_total", "Batches of older instances ignored",
                             registry=r)
        self.gaps = Counter("kvflow_materializer_gaps_total", "Gaps in event_id", registry=r)
        self.anomalies = Counter("kvflow_materializer_anomalies_total", "Events contradicting the stored state",
                                 registry=r)
        self.resyncs = Counter("kvflow_materializer_resync_requests_total", "Snapshots requested", registry=r)
        self.dlq = Counter("kvflow_materializer_dlq_total", "Messages sent to the DLQ", ["reason"], registry=r)
        self.db_retries = Counter("kvflow_materializer_db_retries_total", "Transactions retried", registry=r)
        self.stats = Counter("kvflow_materializer_node_stats_total", "NodeStats applied", registry=r)
        self.freshness = Histogram(
            "kvflow_materializer_freshness_seconds", "From a node publishing a batch to its commit",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.txn_seconds = Histogram("kvflow_materializer_transaction_seconds", "Time of one apply transaction",
                                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.takes = Counter("kvflow_materializer_takes_total", "Takes written, by who planned them "
                             "(compiled: the hot path alone; parts: it and the reference planner; python)",
                             ["planner"], registry=r)
        self.last_commit = Gauge("kvflow_materializer_last_commit_timestamp_seconds", "Unix time of the last commit",
                                 registry=r)


def _credentials(k: KafkaSettings) -> dict[str, Any]:
    """faust/aiokafka settings for the same security configuration the librdkafka clients use."""
    if not k.uses_sasl and k.security_protocol.value != "SSL":
        return {}
    tls = k.security_protocol in (KafkaSecurityProtocol.SSL, KafkaSecurityProtocol.SASL_SSL)
    # faust picks SASL_SSL over SASL_PLAINTEXT by the presence of an SSL context, so TLS always gets one
    # (the system's trust store unless a CA file is named).
    context = ssl.create_default_context(cafile=k.ssl_ca_location) if tls else None
    if k.uses_sasl:
        return {"broker_credentials": faust.SASLCredentials(
            username=k.sasl_username or "",
            password=k.sasl_password.get_secret_value() if k.sasl_password else "",
            mechanism=k.sasl_mechanism, ssl_context=context)}
    return {"broker_credentials": faust.SSLCredentials(context)}


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        # faust passes fetch_max_wait_ms=1500 and has no setting for it. aiokafka does not fetch a
        # partition again while its last records are still being consumed, and sends at most one
        # fetch per broker at a time: a fetch of the other partitions, with nothing new to return,
        # holds the broker's connection for up to this long while the consumed ones wait. Stalls of
        # 0.5-0.7 s were seen mid-stream. The consumer reads this attribute when it starts its fetcher.
        consumer._fetch_max_wait_ms = self.app.kvflow_fetch_max_wait_ms  # type: ignore[attr-defined]
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Transport(faust_aiokafka.Transport):
    """faust's aiokafka transport, with a fetch wait of our own (see :class:`_ConsumerThread`)."""

    Consumer = _Consumer


def build_app(kafka: KafkaSettings | None = None, db: DatabaseSettings | None = None,
              ms: MaterializerSettings | None = None) -> faust.App:
    kafka = kafka or KafkaSettings()
    db = db or DatabaseSettings()
    ms = ms or MaterializerSettings()
    env = RuntimeSettings().env
    kafka.check(env)
    db.check(env, reader=False)  # it writes, through the owner role only
    if env is Environment.DEVELOPMENT:
        log.warning("KVFLOW_ENV=development: placeholder secrets are accepted")
    brokers = ";".join(f"kafka://{b.strip()}" for b in kafka.bootstrap.split(","))
    datadir = ms.datadir or str(Path(tempfile.gettempdir()) / f"kvflow-faust-{ms.group_id}")
    app = faust.App(
        ms.group_id,
        broker=brokers,
        value_serializer="raw",
        key_serializer="raw",
        store="memory://",
        datadir=datadir,
        topic_allow_declare=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=ms.session_timeout_s,
        broker_heartbeat_interval=min(3.0, ms.session_timeout_s / 3),
        broker_commit_interval=1.0,
        broker_max_poll_records=ms.batch_max,
        consumer_max_fetch_size=16 * 1024 * 1024,
        stream_buffer_maxsize=max(4096, ms.batch_max * 2),
        web_enabled=ms.web_port > 0,
        web_host=ms.web_host,
        web_port=ms.web_port or 6066,
        web_bind=ms.web_host,
        producer_acks=-1,
        producer_max_request_size=11 * 1024 * 1024,  # the DLQ takes back messages up to 10 MiB
        **_credentials(kafka),
    )
    app.kvflow_fetch_max_wait_ms = ms.fetch_max_wait_ms  # type: ignore[attr-defined]
    app.transport = _Transport(app.conf.broker_consumer, app)
    m = app.kvflow_metrics = Metrics()  # type: ignore[attr-defined]
    writer = app.kvflow_writer = Writer(db.writer(), pool_size=ms.pool_size,  # type: ignore[attr-defined]
                                        resync_cooldown_s=ms.resync_cooldown_s)
    events_topic = app.topic(kafka.events_topic, key_type=bytes, value_type=bytes)
    stats_topic = app.topic(kafka.stats_topic, key_type=bytes, value_type=bytes)
    dlq_topic = app.topic(kafka.dlq_topic, key_type=bytes, value_type=bytes)
    control_topic = app.topic(kafka.control_topic, key_type=bytes, value_type=bytes)
    state = {"db_ok": False, "last_commit": 0.0}

    def on_retry(exc: BaseException, delay: float) -> None:
        m.db_retries.inc()
        state["db_ok"] = False
        log.warning("database unavailable (%s: %s); retrying in ~%.1f s", type(exc).__name__, exc, delay)

    async def retrying(fn: Any) -> Any:
        return await with_retry(fn, on_retry=on_retry, reconnect=writer.reset_pool)

    async def to_dlq(bad: Sequence[tuple[Any, str, str]]) -> None:
        """Each bad message to the DLQ, delivered before the originals are acknowledged. It never
        raises: a message the DLQ cannot take whole goes truncated (with its size in a header)."""
        for msg, reason, detail in bad:
            m.dlq.labels(reason).inc()
            log.warning("DLQ %s[%s]@%s: %s: %s", msg.topic, msg.partition, msg.offset, reason, detail[:200])
            headers = [("kvflow-error-reason", reason.encode()), ("kvflow-error", detail[:1000].encode()),
                       ("kvflow-source-topic", str(msg.topic).encode()),
                       ("kvflow-source-partition", str(msg.partition).encode()),
                       ("kvflow-source-offset", str(msg.offset).encode())]
            value = msg.value or b""
            for attempt in range(2):
                try:
                    await (await dlq_topic.send(key=msg.key, value=value, headers=headers))
                    break
                except Exception as exc:  # e.g. larger than the DLQ accepts
                    if attempt == 1:
                        m.dlq.labels("dlq_send_failed").inc()
                        log.error("could not put %s[%s]@%s on the DLQ: %s", msg.topic, msg.partition, msg.offset,
                                  exc)
                        break
                    value = value[:DLQ_TRUNCATE_BYTES]
                    headers = [*headers, ("kvflow-truncated-from-bytes", str(len(msg.value or b"")).encode())]

    def record(applied: Applied, seconds: float) -> list[str]:
        """Metrics of a committed transaction; returns the nodes to ask for a snapshot now."""
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
        state["db_ok"], state["last_commit"] = True, now
        return applied.resync_now

    async def ask_for_snapshots(nodes: list[str]) -> None:
        for node in nodes:
            m.resyncs.inc()
            log.info("asking %s for a snapshot", node)
            cmd = ControlCommand(schema_version=1, node_id=node, command="resync", reason="event_id gap",
                                 ts=time.time())
            await control_topic.send(key=node.encode(), value=encode(cmd))

    async def apply_reading(items: list[tuple[Any, EventBatch]]) -> None:
        """The slow path: plan inside the transaction from what the database holds; if the data
        cannot be applied at all, find the culprits one by one (DLQ)."""
        t0 = time.perf_counter()
        try:
            applied = await retrying(lambda: writer.apply([b for _, b in items]))
        except Exception as exc:  # not transient: retrying the same data fails the same way
            if len(items) > 1:
                log.error("transaction failed (%s); applying %d batches one by one", exc, len(items))
                for item in items:
                    await apply_reading([item])
                return
            log.exception("batch could not be applied")
            await to_dlq([(items[0][0], "apply_failed", f"{type(exc).__name__}: {exc}")])
            return
        await ask_for_snapshots(record(applied, time.perf_counter() - t0))

    native = ms.native and state_store.native.available()
    log.info("planning: %s", "compiled hot path (kvflow_native) and Python" if native else "Python")
    pipeline = EventsPipeline(writer, retrying, apply_reading, record, ask_for_snapshots, native=native,
                              batch_max=ms.batch_max)
    app.kvflow_pipeline = pipeline  # type: ignore[attr-defined]

    @app.agent(events_topic, name="kv-events")
    async def consume_events(stream: Any) -> None:  # faust.Stream; its typing is loose
        pipeline.start(stream.ack)
        async for evs in stream.noack_take(ms.batch_max, within=ms.batch_within_s):
            good: list[tuple[Any, EventBatch]] = []
            bad: list[tuple[Any, str, str]] = []
            for i, e in enumerate(evs):
                if i % 16 == 15:  # decoding is CPU work: let the previous take's COPY stream meanwhile
                    await asyncio.sleep(0)
                msg = e.message
                try:
                    batch = decode_batch(msg.value or b"")
                    if msg.key is not None and msg.key != batch.node_id.encode():
                        raise ProtocolError("key_mismatch", f"message key {msg.key[:64]!r} is not node_id "
                                                            f"{batch.node_id!r}")
                    good.append((msg, batch))
                except ProtocolError as exc:
                    bad.append((msg, exc.reason, exc.message))
            if bad:
                await to_dlq(bad)
            await pipeline.submit(good, evs)

    @app.agent(stats_topic, name="node-stats")
    async def consume_stats(stream: Any) -> None:
        async for evs in stream.noack_take(1000, within=0.2):
            good: list[NodeStats] = []
            bad: list[tuple[Any, str, str]] = []
            for e in evs:
                try:
                    good.append(decode_stats(e.message.value or b""))
                except ProtocolError as exc:
                    bad.append((e.message, exc.reason, exc.message))
            if bad:
                await to_dlq(bad)
            if good:
                await retrying(functools.partial(writer.run, functools.partial(apply_stats, stats=good)))
                m.stats.inc(len(good))
            for e in evs:
                await stream.ack(e)

    @app.timer(interval=1.0)
    async def liveness() -> None:
        try:
            gone = await writer.run(lambda conn: mark_liveness(conn, ms.stale_after_s, ms.gone_after_s))
            for node in gone:
                log.info("node %s is gone: its blocks were cleared", node)
        except TRANSIENT as exc:
            state["db_ok"] = False
            log.debug("liveness check skipped: %s", exc)

    @app.timer(interval=600.0)
    async def maintenance() -> None:
        try:
            await writer.run(lambda conn: run_maintenance(conn, ms.retention_days))
        except TRANSIENT as exc:
            log.warning("maintenance skipped: %s", exc)

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        body = {"status": "ok", "db_ok": state["db_ok"], "last_commit": state["last_commit"],
                "group_id": ms.group_id}
        return web.json(body)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(m.registry), content_type="text/plain; version=0.0.4")

    return app


@dataclass
class _Item:
    items: list[tuple[Any, EventBatch]]
    events: list[Any]  # faust events to acknowledge once committed
    plan: Plan | None
    expected: dict[str, tuple[str, int] | None]
    generation: int


class EventsPipeline:
    """Two stages, so that Python and PostgreSQL work at the same time.

    The faust agent hands each take of decoded batches to :meth:`submit`, which only queues it.
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
    the slow path: planned inside their transaction from what the database holds
    (``Writer.apply``).
    """

    def __init__(self, writer: Writer, retrying: Any, slow_path: Any, record: Any, ask: Any,
                 depth: int = 2, native: bool = False, batch_max: int = 2000) -> None:
        self.writer = writer
        self.retrying = retrying
        self.slow_path = slow_path
        self.record = record
        self.ask = ask
        self.batch_max = batch_max
        self.cache: NodeCache = state_store.native.NativeNodeCache() if native else NodeCache()
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.slots = asyncio.Semaphore(depth)
        self.pending: collections.deque[tuple[list[tuple[Any, EventBatch]], list[Any]]] = collections.deque()
        self.pending_messages = 0
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self.generation = 0
        self.stale_caches = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._ack: Any = None

    def start(self, ack: Any) -> None:
        """Start (or restart, after the agent restarted) the two stages."""
        self._ack = ack
        loops = (self._plan_loop, self._write_loop)
        if not self._tasks:
            self._tasks = [asyncio.ensure_future(loop()) for loop in loops]
        for i, loop in enumerate(loops):
            if self._tasks[i].done():
                self._tasks[i] = asyncio.ensure_future(loop())

    def invalidate(self) -> None:
        self.generation += 1
        self.cache.clear()

    async def submit(self, items: list[tuple[Any, EventBatch]], events: list[Any]) -> None:
        """Queue a take (its good batches; all its faust events, acknowledged once written)."""
        self.pending.append((items, events))
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
            items: list[tuple[Any, EventBatch]] = []
            events: list[Any] = []
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
                self.invalidate()
                item = _Item(items, events, None, {}, self.generation)
            self.queue.put_nowait(item)

    async def _prepare(self, items: list[tuple[Any, EventBatch]], events: list[Any]) -> _Item:
        gen = self.generation
        p: Plan | None = None
        expected: dict[str, tuple[str, int] | None] = {}
        if items:
            batches = [b for _, b in items]
            node_ids = {b.node_id for b in batches}
            missing = self.cache.missing(node_ids)
            if missing:
                nodes, blocks = await self.retrying(lambda: self.writer.load(missing))
                if gen == self.generation:
                    self.cache.load(nodes, blocks, missing)
            if gen == self.generation:
                expected = self.cache.expected(node_ids)
                p = await self._plan(batches, gen)
        return _Item(items, events, p, expected, gen)

    async def _plan(self, batches: list[EventBatch], gen: int) -> Plan | None:
        """The take's plan, applied to the cache (None: the cache was dropped meanwhile, and the
        take goes the slow path). Only this coroutine plans.

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
        parts: list[Plan] = []
        if head and (part := await self._plan_python(head, gen)) is not None:
            parts.append(part)
        excluded: set[str] = set()
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
                part = fast.finish()
                cache.apply(part)
                if part.counts.batches:
                    parts.append(part)
                break
        rest = [b for b in tail if b.node_id in excluded]
        if rest and (part := await self._plan_python(rest, gen)) is not None:
            parts.append(part)
        if gen != self.generation:
            return None
        return Plan.sequence(parts)

    async def _plan_python(self, batches: list[EventBatch], gen: int) -> Plan | None:
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

    async def _write_loop(self) -> None:
        while True:
            item = await self.queue.get()
            try:
                await self._write(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # never lose the loop; the messages stay unacknowledged
                log.exception("writing a take failed; dropping the cache and retrying it")
                self.invalidate()
                await self.slow_path(item.items)
            try:
                for e in item.events:
                    await self._ack(e)
            finally:
                self.slots.release()

    async def _write(self, item: _Item) -> None:
        if not item.items:
            return
        if item.plan is None or item.generation != self.generation:
            await self.slow_path(item.items)
            return
        t0 = time.perf_counter()
        try:
            applied = await self.retrying(lambda: self.writer.apply_planned(item.plan, item.expected))
        except StaleCache as exc:
            self.stale_caches += 1
            log.info("cache out of date (%s): replanning from the database", exc)
            self.invalidate()
            await self.slow_path(item.items)
            return
        except Exception as exc:  # the data cannot be applied as planned: slow path isolates it
            log.error("planned transaction failed (%s: %s); replanning from the database", type(exc).__name__, exc)
            self.invalidate()
            await self.slow_path(item.items)
            return
        await self.ask(self.record(applied, time.perf_counter() - t0))


STATS_UPSERT = """
INSERT INTO nodes AS n (node_id, instance_id, url, model, block_size, capacity_gpu, capacity_host, used_gpu,
                        used_host, active_requests, queued_requests, reported_event_id, counters, last_seen,
                        last_stats_at, status, active_blocks)
SELECT u.node_id, u.instance_id, u.url, u.model, u.block_size, u.cap_gpu, u.cap_host, u.used_gpu, u.used_host,
       u.active, u.queued, u.last_event_id, u.counters::jsonb, now(), now(), 'live', u.active_blocks
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[], $7::int[], $8::int[], $9::int[],
            $10::int[], $11::int[], $12::bigint[], $13::text[], $14::int[])
     AS u(node_id, instance_id, url, model, block_size, cap_gpu, cap_host, used_gpu, used_host, active, queued,
          last_event_id, counters, active_blocks)
ON CONFLICT (node_id) DO UPDATE SET
  url = EXCLUDED.url, model = EXCLUDED.model, block_size = EXCLUDED.block_size,
  capacity_gpu = EXCLUDED.capacity_gpu, capacity_host = EXCLUDED.capacity_host,
  used_gpu = EXCLUDED.used_gpu, used_host = EXCLUDED.used_host,
  active_requests = EXCLUDED.active_requests, queued_requests = EXCLUDED.queued_requests,
  active_blocks = EXCLUDED.active_blocks,
  reported_event_id = EXCLUDED.reported_event_id, counters = EXCLUDED.counters,
  last_seen = now(), last_stats_at = now(), updated_at = now(),
  -- A heartbeat brings a stale node back; a gone node's blocks were cleared, so it stays gone
  -- until its events (a snapshot) bring it back.
  status = CASE WHEN n.status = 'stale' THEN 'live' ELSE n.status END,
  status_changed_at = CASE WHEN n.status = 'stale' THEN now() ELSE n.status_changed_at END
"""
STATS_SAMPLES = """
INSERT INTO node_stats_samples (node_id, instance_id, ts, capacity_gpu, capacity_host, used_gpu, used_host,
                                active_requests, queued_requests, prompt_tokens, cached_tokens, counters)
SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int[], $5::int[], $6::int[], $7::int[],
                     $8::int[], $9::int[], $10::bigint[], $11::bigint[], $12::jsonb[])
ON CONFLICT DO NOTHING
"""


async def apply_stats(conn: Any, *, stats: Sequence[NodeStats]) -> None:
    from datetime import UTC, datetime

    import msgspec

    latest: dict[str, NodeStats] = {}
    for s in stats:
        if s.node_id not in latest or s.ts >= latest[s.node_id].ts:
            latest[s.node_id] = s
    rows = list(latest.values())
    async with conn.transaction():
        await conn.execute(
            STATS_UPSERT, [s.node_id for s in rows], [s.instance_id for s in rows], [s.url for s in rows],
            [s.model for s in rows], [s.block_size for s in rows], [s.capacity[0] for s in rows],
            [s.capacity[1] for s in rows], [s.used[0] for s in rows], [s.used[1] for s in rows],
            [s.active_requests for s in rows], [s.queued_requests for s in rows], [s.last_event_id for s in rows],
            [msgspec.json.encode(s.counters).decode() for s in rows], [s.active_blocks for s in rows])
        await conn.execute(
            STATS_SAMPLES, [s.node_id for s in stats], [s.instance_id for s in stats],
            [datetime.fromtimestamp(s.ts, tz=UTC) for s in stats], [s.capacity[0] for s in stats],
            [s.capacity[1] for s in stats], [s.used[0] for s in stats], [s.used[1] for s in stats],
            [s.active_requests for s in stats], [s.queued_requests for s in stats],
            [s.counters.prompt_tokens for s in stats], [s.counters.cached_tokens for s in stats],
            [msgspec.json.encode(s.counters).decode() for s in stats])


LIVENESS = """
WITH stale AS (
  UPDATE nodes SET status = 'stale', status_changed_at = now()
  WHERE status IN ('live', 'resyncing') AND last_seen < now() - make_interval(secs => $1)
  RETURNING node_id
), gone AS (
  UPDATE nodes SET status = 'gone', status_changed_at = now()
  WHERE status = 'stale' AND last_seen < now() - make_interval(secs => $2)
  RETURNING node_id
), cleared AS (
  DELETE FROM node_blocks WHERE node_id IN (SELECT node_id FROM gone) RETURNING node_id
)
SELECT node_id FROM gone
"""


async def mark_liveness(conn: Any, stale_after_s: float, gone_after_s: float) -> list[str]:
    """live/resyncing → stale after ``stale_after_s`` of silence; stale → gone (blocks cleared) after
    ``gone_after_s``."""
    rows = await conn.fetch(LIVENESS, stale_after_s, gone_after_s)
    return [r["node_id"] for r in rows]


async def run_maintenance(conn: Any, retention_days: float) -> None:
    """Partitions ahead and retention, by one worker at a time (advisory lock)."""
    async with conn.transaction():
        if await conn.fetchval("SELECT pg_try_advisory_xact_lock(hashtext('kvflow-maintenance'))"):
            await conn.execute("SELECT kvflow_ensure_block_event_partitions(7)")
            await conn.execute("SELECT kvflow_apply_retention(make_interval(secs => $1))",
                               retention_days * 86400.0)


#: Python's cyclic garbage collector, for a process that decodes ~100 MB of JSON into short-lived
#: lists a second: collect the youngest generation every 50,000 tracked allocations (not 700).
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc() -> None:
    """Fewer, cheaper collections. By default each full collection walked every object of the
    process (faust, aiokafka, …) and took 100-150 ms, stalling the event loop (and the COPY it
    feeds); ``kvflow bench pipeline`` measured 0.24-0.45 s of collection per round, 0.04-0.06 s
    after this. The objects made at start-up are frozen (never collected: they live as long as
    the process), and young collections run far less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_worker(app: faust.App, loglevel: str = "info") -> None:
    """Run one worker in this process until SIGTERM/SIGINT (faust handles the signals)."""
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    tune_gc()
    worker.execute_from_commandline()
