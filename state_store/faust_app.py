"""The faust-streaming worker of the materializer: thin wiring around :class:`~state_store.materializer.Materializer`.

:func:`build_app` makes the faust app: an agent per topic (``kv-events``, ``node-stats``), the
liveness and maintenance timers, and the ``/healthz`` and ``/metrics`` pages, each calling one
method of the app's :class:`~state_store.materializer.Materializer`. :func:`run_worker` runs it
(``kvflow materializer``).
"""

from __future__ import annotations

import gc
import logging
import ssl
import tempfile
from pathlib import Path
from typing import Any

import faust
from faust.exceptions import ConsumerNotStarted

from eventbus.config import Environment, KafkaSecurityProtocol, KafkaSettings, RuntimeSettings
from state_store.config import DatabaseSettings, MaterializerSettings
from state_store.faust_compat import FetchWaitTransport, group_generation
from state_store.materializer import Materializer
from state_store.writer import Writer

log = logging.getLogger("kvflow.materializer")


def broker_credentials(k: KafkaSettings) -> dict[str, Any]:
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


class FaustOutbox:
    """The materializer's :class:`~state_store.materializer.Outbox` on faust topics."""

    def __init__(self, dlq: faust.TopicT, control: faust.TopicT) -> None:
        self.dlq = dlq
        self.control = control

    async def send_dlq(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        await (await self.dlq.send(key=key, value=value, headers=headers))

    async def send_control(self, key: bytes, value: bytes) -> None:
        await self.control.send(key=key, value=value)


def partitions_assigned(app: faust.App) -> int:
    """The partitions the worker's consumer has now (0 before it started)."""
    try:
        return len(app.consumer.assignment())
    except ConsumerNotStarted:
        return 0


def _make_app(kafka: KafkaSettings, ms: MaterializerSettings) -> faust.App:
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
        **broker_credentials(kafka),
    )
    app.transport = FetchWaitTransport(app.conf.broker_consumer, app, fetch_max_wait_ms=ms.fetch_max_wait_ms)
    return app


def build_app(kafka: KafkaSettings | None = None, db: DatabaseSettings | None = None,
              ms: MaterializerSettings | None = None) -> faust.App:
    """The materializer's faust app (settings from the environment unless given).

    Raises:
        ValueError: a refused setting (e.g. a placeholder secret outside development).
    """
    kafka = kafka or KafkaSettings()
    db = db or DatabaseSettings()
    ms = ms or MaterializerSettings()
    env = RuntimeSettings().env
    kafka.check(env)
    db.check(env, reader=False)  # it writes, through the owner role only
    if env is Environment.DEVELOPMENT:
        log.warning("KVFLOW_ENV=development: placeholder secrets are accepted")
    app = _make_app(kafka, ms)
    events_topic = app.topic(kafka.events_topic, key_type=bytes, value_type=bytes)
    stats_topic = app.topic(kafka.stats_topic, key_type=bytes, value_type=bytes)
    outbox = FaustOutbox(app.topic(kafka.dlq_topic, key_type=bytes, value_type=bytes),
                         app.topic(kafka.control_topic, key_type=bytes, value_type=bytes))
    writer = Writer(db.writer(), pool_size=ms.pool_size, resync_cooldown_s=ms.resync_cooldown_s)
    mat = Materializer(ms, writer, outbox)

    @app.agent(events_topic, name="kv-events")
    async def consume_events(stream: Any) -> None:  # faust.Stream; its typing is loose
        mat.start(stream.ack)
        async for events in stream.noack_take(ms.batch_max, within=ms.batch_within_s):
            await mat.handle_events(events)

    @app.agent(stats_topic, name="node-stats")
    async def consume_stats(stream: Any) -> None:
        async for events in stream.noack_take(1000, within=0.2):
            await mat.handle_stats(events)
            for e in events:
                await stream.ack(e)

    @app.on_partitions_revoked.connect
    async def on_revoked(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        revoked = args[0] if args else kwargs.get("revoked", ())
        mat.partitions_revoked(sum(1 for tp in revoked if tp.topic == kafka.events_topic))

    @app.timer(interval=1.0)
    async def liveness() -> None:
        await mat.liveness()

    @app.timer(interval=1.0)
    async def resync_repeats() -> None:
        await mat.repeat_resyncs()

    @app.timer(interval=600.0)
    async def maintenance() -> None:
        await mat.maintenance()

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        health = await mat.health(partitions_assigned(app), group_member=group_generation(app) >= 0)
        return web.json(health.body, status=health.status_code)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.bytes(mat.metrics_text(), content_type="text/plain; version=0.0.4")

    return app


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
