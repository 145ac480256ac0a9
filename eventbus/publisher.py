"""From the KV core's event queue to Kafka: batching, delivery, back-pressure, heartbeats.

A :class:`Publisher` drains the core (``KVCacheManager.drain_events``) into ``EventBatch``es and
hands them to a sink. Sinks (chosen by configuration, as vLLM's ``EventPublisherFactory``
does): :class:`NullSink` (events dropped, for nodes without Kafka), :class:`InMemorySink`
(tests), :class:`KafkaSink` (an idempotent confluent-kafka producer: acks=all, lz4, batching,
keyed by node id so a node's events stay in one partition, in order).

A Kafka outage never stalls inference. The publisher stops draining while the sink holds more
than ``max_in_flight`` undelivered batches, so events wait in the core's bounded queue; if that
overflows, the core replaces what it queued by a ``snapshot`` (and counts the loss), which is
published once Kafka is back. A batch that the broker finally refuses also triggers a snapshot.
Batches stay under ``PUBLISH_BATCH_BYTES`` encoded (a large snapshot comes in parts, see
``eventbus.protocol.Snapshot``), so consumers never refuse one for its size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from eventbus.config import KafkaSettings
from eventbus.protocol import (
    PUBLISH_BATCH_BYTES,
    ControlCommand,
    Event,
    EventBatch,
    InstanceId,
    NodeId,
    NodeStats,
    ProtocolError,
    Removed,
    Snapshot,
    Stored,
    decode_control,
    encode,
)

log = logging.getLogger("kvflow.publisher")


class EventSource(Protocol):
    """What a publisher drains: the KV core (``KVCacheManager``), or a bridge's translator
    (``bridge.translate.Translator``)."""

    def drain_events(self, max_events: int | None = None) -> list[Event]: ...
    def request_snapshot(self) -> None: ...


class Sink(Protocol):
    """Where batches and heartbeats go."""

    def send_batch(self, batch: EventBatch) -> None: ...
    def send_stats(self, stats: NodeStats) -> None: ...
    def poll(self) -> None: ...
    def in_flight(self) -> int: ...
    def failed(self) -> int: ...
    def flush(self, timeout: float) -> int: ...
    def close(self) -> None: ...


class NullSink:
    """Drops everything (a node run without Kafka)."""

    def send_batch(self, batch: EventBatch) -> None:
        pass

    def send_stats(self, stats: NodeStats) -> None:
        pass

    def poll(self) -> None:
        pass

    def in_flight(self) -> int:
        return 0

    def failed(self) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        return 0

    def close(self) -> None:
        pass


@dataclass
class InMemorySink:
    """Keeps what it is sent (tests). ``hold=True`` simulates an outage: nothing is delivered."""

    batches: list[EventBatch] = field(default_factory=list)
    stats: list[NodeStats] = field(default_factory=list)
    hold: bool = False
    held: list[EventBatch] = field(default_factory=list)

    def send_batch(self, batch: EventBatch) -> None:
        (self.held if self.hold else self.batches).append(batch)

    def send_stats(self, stats: NodeStats) -> None:
        self.stats.append(stats)

    def poll(self) -> None:
        if not self.hold and self.held:
            self.batches.extend(self.held)
            self.held.clear()

    def in_flight(self) -> int:
        return len(self.held)

    def failed(self) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        self.poll()
        return len(self.held)

    def close(self) -> None:
        pass


class KafkaSink:
    """An idempotent producer to ``kv-events`` and ``node-stats``."""

    def __init__(self, settings: KafkaSettings, node_id: NodeId, **overrides: Any) -> None:
        from eventbus.kafka import make_producer

        self.settings = settings
        self.key = node_id.encode()
        self.producer = make_producer(settings, **{"client.id": f"kvflow-node-{node_id}", **overrides})
        self._failed = 0
        self._delivered = 0
        self.last_error: str | None = None

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self._failed += 1
            self.last_error = str(err)
            log.error("event batch not delivered: %s", err)
        else:
            self._delivered += 1

    def send_batch(self, batch: EventBatch) -> None:
        self._produce(self.settings.events_topic, encode(batch), self._on_delivery)

    def send_stats(self, stats: NodeStats) -> None:
        self._produce(self.settings.stats_topic, encode(stats), None)

    def _produce(self, topic: str, value: bytes, cb: Any) -> None:
        from confluent_kafka import KafkaException

        while True:
            try:
                self.producer.produce(topic, key=self.key, value=value, on_delivery=cb)
                return
            except BufferError:  # librdkafka's own queue is full: serve callbacks, try again
                self.producer.poll(0.05)
            except KafkaException as exc:  # refused at once (e.g. too large): lost, like a failed delivery
                self.last_error = str(exc)
                log.error("message to %s refused (%d bytes): %s", topic, len(value), exc)
                if cb is not None:
                    self._failed += 1
                return

    def poll(self) -> None:
        self.producer.poll(0)

    def in_flight(self) -> int:
        """Messages not yet delivered, as librdkafka counts them (``len(producer)``: its own protocol
        requests waiting for a broker too, a few at most; fine for backpressure)."""
        return len(self.producer)

    def failed(self) -> int:
        return self._failed

    @property
    def delivered(self) -> int:
        """Event batches the brokers acknowledged (delivery reports served so far)."""
        return self._delivered

    def flush(self, timeout: float) -> int:
        return int(self.producer.flush(timeout))

    def close(self) -> None:
        self.producer.flush(5)


class Publisher:
    """Drains one core into batches for one sink (call :meth:`pump` from the core's thread)."""

    def __init__(self, core: EventSource, sink: Sink, node_id: NodeId, instance_id: InstanceId, *,
                 max_events_per_batch: int = 2000, max_in_flight: int = 1000,
                 max_batch_bytes: int = PUBLISH_BATCH_BYTES, clock: Callable[[], float] = time.time) -> None:
        self.core = core
        self.sink = sink
        self.node_id = node_id
        self.instance_id = instance_id
        self.max_events_per_batch = max_events_per_batch
        self.max_in_flight = max_in_flight
        self.max_batch_bytes = max_batch_bytes
        self.clock = clock
        self.batches_sent = 0
        self.events_sent = 0
        self._failed_seen = 0
        self.last_sent_event_id = -1

    @property
    def backlogged(self) -> bool:
        return self.sink.in_flight() >= self.max_in_flight

    def pump(self) -> int:
        """Send what the core queued (unless the sink is backlogged); return events sent."""
        self.sink.poll()
        failed = self.sink.failed()
        if failed > self._failed_seen:  # a batch was lost for good: the consumer needs the whole state
            self._failed_seen = failed
            self.core.request_snapshot()
        sent = 0
        while not self.backlogged:
            events = self.core.drain_events(self.max_events_per_batch)
            if not events:
                break
            self._send(events)
            sent += len(events)
            self.last_sent_event_id = events[-1].event_id
        self.events_sent += sent
        return sent

    def drain(self, timeout: float) -> int:
        """Send everything the source has queued and wait for the sink to deliver it, for at most
        ``timeout`` seconds; return what is left undelivered (0: everything).

        One :meth:`pump` and a flush are not enough: while the sink is backlogged (a broker lost, a
        leader moving) :meth:`pump` sends nothing, the flush then delivers the backlog, and the
        events still queued in the source stay there (a stopping node lost them). Here each flush
        is followed by another pump until the source is empty."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            left = deadline - time.monotonic()
            if not self.backlogged:  # pump stopped because the source had nothing more
                return self.sink.flush(max(0.0, left))
            if left <= 0:
                return max(1, self.sink.in_flight())
            self.sink.flush(min(left, 0.5))

    def _send(self, events: list[Event]) -> None:
        """One batch, or several in order when it would encode larger than ``max_batch_bytes``."""
        batch = EventBatch(schema_version=1, node_id=self.node_id, instance_id=self.instance_id,
                           ts=self.clock(), events=events)
        # Measuring costs an encode; only batches with many blocks can be near the limit (a block
        # takes at most ~1 KiB of JSON, with its token ids).
        if len(events) > 1 and _blocks(events) * 1024 > self.max_batch_bytes \
                and len(encode(batch)) > self.max_batch_bytes:
            mid = len(events) // 2
            self._send(events[:mid])
            self._send(events[mid:])
            return
        self.sink.send_batch(batch)
        self.batches_sent += 1


def _blocks(events: list[Event]) -> int:
    n = 0
    for e in events:
        d = e.data
        n += len(d.block_hashes) if isinstance(d, Removed) else len(d.blocks) if isinstance(d, Stored | Snapshot) else 1
    return n


class ControlListener:
    """Reads ``kv-control`` for this node (e.g. resync requests) on a background thread.

    It does not touch the core: it sets a flag that the core's owner checks (``take_resync``).
    """

    def __init__(self, settings: KafkaSettings, node_id: NodeId, instance_id: InstanceId) -> None:
        from eventbus.kafka import make_consumer

        self.node_id = node_id
        self.topic = settings.control_topic
        # Its own group per node instance, reading only what is new.
        self.consumer = make_consumer(settings, group_id=f"kvflow-node-{node_id}-{instance_id}",
                                      **{"auto.offset.reset": "latest", "enable.auto.commit": True})
        self._resync = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"control-{node_id}", daemon=True)
        self.received: list[ControlCommand] = []

    def start(self) -> None:
        self.consumer.subscribe([self.topic])
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.consumer.poll(0.5)
            except Exception as exc:  # never let the listener kill the node
                log.warning("control consumer: %s", exc)
                time.sleep(1)
                continue
            if msg is None or msg.error() is not None:
                continue
            if msg.key() != self.node_id.encode():
                continue
            try:
                cmd = decode_control(msg.value() or b"")
            except ProtocolError as exc:
                log.warning("ignoring a bad control message: %s", exc)
                continue
            if cmd.node_id != self.node_id:  # the key said us, the body someone else: trust neither
                log.warning("ignoring a control message keyed %s for node %s", self.node_id, cmd.node_id)
                continue
            self.received.append(cmd)
            if cmd.command == "resync":
                log.info("resync requested: %s", cmd.reason)
                self._resync.set()

    def take_resync(self) -> bool:
        """True once per resync request received since the last call."""
        if self._resync.is_set():
            self._resync.clear()
            return True
        return False

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.consumer.close()
