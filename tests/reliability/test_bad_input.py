"""Bad input on Kafka: each gets the DLQ (or is recognized and ignored), and nothing else changes."""

from __future__ import annotations

import json
import time

import pytest
from confluent_kafka import Producer

from eventbus import protocol as p
from eventbus.kafka import make_consumer
from tests.support import (
    CoreNode,
    applied_through,
    fetch,
    history_duplicates,
    materializer,
    node_row,
    sql_blocks,
    wait_for,
)

pytestmark = pytest.mark.integration


def batch_json(node: str, inst: str, first: int, blocks: list[int]) -> bytes:
    return json.dumps({"schema_version": 1, "node_id": node, "instance_id": inst, "ts": time.time(), "events": [
        {"event_id": first, "window_size": 64, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"block_hash": h, "num_tokens": 4} for h in blocks]}}]}).encode()


def test_bad_messages_go_to_the_dlq_and_replays_change_nothing(kafka_settings, migrated_database_url, tmp_path):
    db = migrated_database_url
    node = CoreNode(kafka_settings, "node-b", seed=5)
    sent: list[p.EventBatch] = []
    send = node.sink.send_batch

    def keep(b: p.EventBatch) -> None:
        sent.append(b)
        send(b)

    node.sink.send_batch = keep  # type: ignore[method-assign]
    mat = materializer(kafka_settings, db, tmp_path).start()
    producer = Producer({"bootstrap.servers": kafka_settings.bootstrap, "message.max.bytes": 10_000_000})
    try:
        node.run(80)
        node.finish()
        wait_for(lambda: applied_through(db, node), 60, what="the good stream")
        truth = sql_blocks(db, "node-b")
        assert truth == node.truth()

        big_hash = (1 << 64) + 5
        bad = {
            batch_json("node-b", node.instance_id, 10_000, [-1]): "invalid",
            batch_json("node-b", node.instance_id, 10_000, [big_hash]): "invalid",
            b'{"schema_version": 1, "node_id": "node-b"': "malformed_json",
            json.dumps({"schema_version": 2, "node_id": "node-b"}).encode(): "unknown_schema_version",
            batch_json("node-b", node.instance_id, 10_000, list(range(1, 9_000_000 // 40))): "too_large",
        }
        for raw in bad:
            producer.produce(kafka_settings.events_topic, key=b"node-b", value=raw)
        # Replays of batches already applied: recognized by last_event_id, no effect.
        for b in sent[:5]:
            producer.produce(kafka_settings.events_topic, key=b"node-b", value=p.encode(b))
        # Events of an instance nobody has seen start, mid-stream: a gap (resync), not a crash.
        producer.produce(kafka_settings.events_topic, key=b"ghost",
                         value=batch_json("ghost", "unknown-instance", 57, [424242]))
        assert producer.flush(30) == 0

        consumer = make_consumer(kafka_settings, group_id="t-bad-dlq")
        consumer.subscribe([kafka_settings.dlq_topic])
        reasons = []
        deadline = time.monotonic() + 30
        while len(reasons) < len(bad) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                reasons.append(dict(msg.headers())["kvflow-error-reason"].decode())
        consumer.close()
        assert sorted(reasons) == sorted(bad.values())

        ghost = wait_for(lambda: node_row(db, "ghost"), 30, what="the ghost node")
        assert ghost["status"] == "resyncing" and sql_blocks(db, "ghost") == {}
        # Nothing else changed for node-b.
        assert sql_blocks(db, "node-b") == truth
        assert node_row(db, "node-b")["last_event_id"] == node.core.last_event_id
        assert history_duplicates(db, "node-b") == 0

        # The node restarts; an old batch of its previous instance arrives late: ignored.
        restarted = CoreNode(kafka_settings, "node-b", seed=6)
        restarted.run(30)
        restarted.finish()
        wait_for(lambda: applied_through(db, restarted), 60, what="the new instance")
        late = sent[-1]
        history = fetch(db, "SELECT count(*) AS c FROM block_events WHERE node_id = 'node-b'")[0]["c"]
        partitions: list[int] = []
        producer.produce(kafka_settings.events_topic, key=b"node-b", value=p.encode(late),
                         on_delivery=lambda err, msg: partitions.append(msg.partition()))
        assert producer.flush(30) == 0 and len(partitions) == 1
        # A marker behind it on its partition (another node's first batch): once the marker is in
        # SQL, the late batch was consumed and planned.
        marker = p.EventBatch(schema_version=1, node_id="marker", instance_id="m", ts=time.time(), events=[
            p.Event(event_id=0, window_size=64, data=p.Created(num_blocks_per_cache_level=[4]))])
        producer.produce(kafka_settings.events_topic, key=b"marker", value=p.encode(marker), partition=partitions[0])
        assert producer.flush(30) == 0
        wait_for(lambda: node_row(db, "marker"), 30, what="the marker behind the late batch")
        assert sql_blocks(db, "node-b") == restarted.truth()
        assert node_row(db, "node-b")["instance_id"] == restarted.instance_id
        assert node_row(db, "node-b")["last_event_id"] == restarted.core.last_event_id
        assert fetch(db, "SELECT count(*) AS c FROM block_events WHERE node_id = 'node-b'")[0]["c"] == history
    finally:
        mat.stop()
