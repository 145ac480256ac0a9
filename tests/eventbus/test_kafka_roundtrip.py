"""A produce/consume round trip of the wire schema through the real broker."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import ConfigResource, ResourceType

from eventbus import protocol as p
from eventbus.kafka import admin, ensure_topics, make_consumer, make_producer, topic_specs

pytestmark = pytest.mark.integration


def _batch(node: str, first_id: int, n: int) -> p.EventBatch:
    events = [
        p.Event(event_id=first_id + i, window_size=32,
                data=p.Stored(parent_hash=None,
                              blocks=[p.StoredBlock(block_hash=(1 << 63) + i, num_tokens=32, priority=100)]))
        for i in range(n)
    ]
    return p.EventBatch(schema_version=1, node_id=node, instance_id="inst-1", ts=time.time(), events=events)


def test_topics_are_created_once_with_their_settings(kafka_settings):
    client = admin(kafka_settings)
    md = client.list_topics(timeout=10)
    for spec in topic_specs(kafka_settings):
        assert spec.name in md.topics
        assert len(md.topics[spec.name].partitions) == spec.partitions
    assert len(md.topics[kafka_settings.events_topic].partitions) >= 6
    assert ensure_topics(kafka_settings) == []  # idempotent

    res = ConfigResource(ResourceType.TOPIC, kafka_settings.events_topic)
    cfg = client.describe_configs([res])[res].result(timeout=10)
    assert cfg["retention.ms"].value == str(kafka_settings.events_retention_ms)
    assert cfg["cleanup.policy"].value == "delete"


def test_event_batches_round_trip_in_order_per_node(kafka_settings):
    producer = make_producer(kafka_settings)
    sent: dict[str, list[p.EventBatch]] = {"node-a": [], "node-b": [], "node-c": []}
    delivered: list[tuple[str, int]] = []

    def on_delivery(err, msg):
        assert err is None, err
        delivered.append((msg.key().decode(), msg.partition()))

    for round_ in range(5):
        for node in sent:
            b = _batch(node, round_ * 3, 3)
            sent[node].append(b)
            producer.produce(kafka_settings.events_topic, key=node, value=p.encode(b), on_delivery=on_delivery)
    assert producer.flush(30) == 0
    # All of a node's batches went to one partition.
    for node in sent:
        assert len({part for key, part in delivered if key == node}) == 1

    consumer = make_consumer(kafka_settings, group_id=f"rt-{kafka_settings.events_topic}")
    consumer.subscribe([kafka_settings.events_topic])
    got: dict[str, list[p.EventBatch]] = {n: [] for n in sent}
    deadline = time.monotonic() + 30
    try:
        while sum(map(len, got.values())) < 15 and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            batch = p.decode_batch(msg.value())
            assert msg.key().decode() == batch.node_id
            got[batch.node_id].append(batch)
    finally:
        consumer.close()
    assert got == sent
