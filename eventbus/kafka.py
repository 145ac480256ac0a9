"""Kafka helpers used by every component: topic administration, producers, consumers.

All clients are confluent-kafka (librdkafka) configured from :class:`KafkaSettings`, so
security settings (SASL/SCRAM, TLS) apply everywhere at once. The materializer's faust app maps
the same settings onto aiokafka (``state_store.faust_app``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from eventbus.config import KafkaSettings


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str]


def topic_specs(s: KafkaSettings) -> list[TopicSpec]:
    """The topics of docs/architecture.md#kafka with their retention settings."""
    big = str(10 * 1024 * 1024)
    return [
        TopicSpec(s.events_topic, max(6, s.events_partitions), {
            "cleanup.policy": "delete",
            "retention.ms": str(s.events_retention_ms),
            "max.message.bytes": big,
        }),
        # Heartbeats: the latest per node matters, history only for a while.
        TopicSpec(s.stats_topic, max(6, s.events_partitions), {
            "cleanup.policy": "compact,delete",
            "retention.ms": str(s.stats_retention_ms),
            "segment.ms": str(3600 * 1000),
        }),
        TopicSpec(s.dlq_topic, 1, {
            "cleanup.policy": "delete",
            "retention.ms": str(s.events_retention_ms * 4),
            "max.message.bytes": big,
        }),
        TopicSpec(s.control_topic, max(6, s.events_partitions), {
            "cleanup.policy": "delete",
            "retention.ms": str(3600 * 1000),
        }),
    ]


def admin(s: KafkaSettings) -> AdminClient:
    return AdminClient(s.librdkafka())


def ensure_topics(s: KafkaSettings, timeout: float = 30.0) -> list[str]:
    """Create the topics that are missing (idempotent); return the names it created."""
    client = admin(s)
    md = client.list_topics(timeout=timeout)
    wanted = [t for t in topic_specs(s) if t.name not in md.topics]
    if not wanted:
        return []
    replicas = s.replication_factor or min(3, len(md.brokers))
    futures = client.create_topics(
        [NewTopic(t.name, num_partitions=t.partitions, replication_factor=replicas,
                  config=t.config) for t in wanted],
        operation_timeout=timeout, request_timeout=timeout,
    )
    created: list[str] = []
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout)
            created.append(name)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    wait_for_topics(s, [t.name for t in wanted], timeout=timeout)
    return created


def wait_for_topics(s: KafkaSettings, names: Iterable[str], timeout: float = 30.0) -> None:
    """Block until every named topic has a leader for each partition."""
    client = admin(s)
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending:
        md = client.list_topics(timeout=max(1.0, deadline - time.monotonic()))
        for name in list(pending):
            t = md.topics.get(name)
            if t is not None and t.error is None and t.partitions and all(
                p.leader >= 0 for p in t.partitions.values()
            ):
                pending.discard(name)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics not ready after {timeout:.0f} s: {sorted(pending)}")
            time.sleep(0.1)


def delete_topics(s: KafkaSettings, names: Iterable[str], timeout: float = 30.0) -> None:
    client = admin(s)  # NOTE: the futures fail if the client is collected before they resolve
    futures = client.delete_topics(list(names), operation_timeout=timeout, request_timeout=timeout)
    for fut in futures.values():
        try:
            fut.result(timeout=timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise


#: librdkafka log facilities of a failed connection to a broker (its own retries follow).
_CONNECTION_FAILURES = frozenset({"FAIL", "BROKERFAIL", "ERROR"})


class KafkaLog:
    """librdkafka's log lines through Python logging, with an outage said once, not per retry.

    While brokers cannot be reached librdkafka logs each failed connection attempt (hundreds of
    lines in 30 s for a node's producer and consumer). The first failure after a quiet spell is
    logged as a warning; the following ones are counted and logged as one line every
    ``summary_s``; ``summary_s`` without a failure ends the outage. Every other line passes
    through at its own level. (The ``logger`` of a librdkafka client: it calls ``log(level, fmt,
    facility, client, message)``.)
    """

    def __init__(self, name: str = "kvflow.kafka", summary_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logging.getLogger(name)
        self.summary_s = summary_s
        self.clock = clock
        self.failures = 0  # in all
        self._since_summary = 0
        self._down_at: float | None = None
        self._last_failure = 0.0
        self._last_summary = 0.0

    def log(self, level: int, fmt: str, *args: Any) -> None:
        facility = args[0] if args else ""
        if facility not in _CONNECTION_FAILURES:
            self.logger.log(level, fmt, *args)
            return
        now = self.clock()
        self.failures += 1
        if self._down_at is None or now - self._last_failure >= self.summary_s:
            self._down_at = self._last_summary = now
            self._since_summary = 0
            self.logger.warning("Kafka unreachable: %s (further connection errors are summarized every %.0f s)",
                                args[-1] if args else fmt, self.summary_s)
        else:
            self._since_summary += 1
            if now - self._last_summary >= self.summary_s:
                self.logger.warning("Kafka still unreachable after %.0f s: %d connection errors in the last %.0f s",
                                    now - self._down_at, self._since_summary, now - self._last_summary)
                self._last_summary = now
                self._since_summary = 0
        self._last_failure = now


def make_producer(s: KafkaSettings, **overrides: Any) -> Producer:
    """An idempotent producer: acks=all, ordered per partition, compressed, batched."""
    conf = s.librdkafka(**{
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "lz4",
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "message.max.bytes": 10 * 1024 * 1024,
        "queue.buffering.max.messages": 100_000,
        "message.timeout.ms": 0,  # retry until delivered; a bounded buffer above decides
        "logger": KafkaLog(),
        **overrides,
    })
    return Producer(conf)


def make_consumer(s: KafkaSettings, group_id: str, **overrides: Any) -> Consumer:
    """A consumer in its own group; commits are left to the caller unless overridden."""
    conf = s.librdkafka(**{
        "group.id": group_id,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "enable.partition.eof": False,
        "session.timeout.ms": 10_000,
        "fetch.max.bytes": 64 * 1024 * 1024,
        "max.partition.fetch.bytes": 10 * 1024 * 1024,
        "logger": KafkaLog(),
        **overrides,
    })
    return Consumer(conf)
