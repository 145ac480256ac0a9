"""The invariant after a fault, for an in-process node recorded by its sink: PostgreSQL holds the
node's exact state, each published event once, no gap in event ids, nothing in the DLQ."""

from __future__ import annotations

import threading

from confluent_kafka import TopicPartition

from eventbus.config import KafkaSettings
from eventbus.kafka import make_consumer
from tests.state_store.test_materializer import Recorder, expected_history_rows
from tests.support import CoreNode, fetch, history_duplicates, node_row, sql_blocks


def dlq_messages(k: KafkaSettings) -> int:
    """Messages in the DLQ topic (its high watermarks)."""
    consumer = make_consumer(k, "kvflow-test-dlq-count")
    try:
        md = consumer.list_topics(k.dlq_topic, timeout=10).topics[k.dlq_topic]
        return sum(consumer.get_watermark_offsets(TopicPartition(k.dlq_topic, p), timeout=10)[1]
                   for p in md.partitions)
    finally:
        consumer.close()


def assert_exact(db: str, node: CoreNode, rec: Recorder, k: KafkaSettings) -> None:
    row = node_row(db, node.node_id)
    assert row is not None and row["status"] == "live" and row["resync_attempts"] == 0
    assert row["instance_id"] == node.instance_id and row["last_event_id"] == node.core.last_event_id
    assert sql_blocks(db, node.node_id) == node.truth()
    assert history_duplicates(db, node.node_id) == 0
    rows = fetch(db, "SELECT count(*) AS c FROM block_events WHERE node_id = $1", node.node_id)[0]["c"]
    assert rows == expected_history_rows(rec.events)
    ids = [r["event_id"] for r in fetch(db, "SELECT DISTINCT event_id FROM block_events WHERE node_id = $1 "
                                            "ORDER BY 1", node.node_id)]
    published = sorted({e.event_id for e in rec.events})
    assert ids == published == list(range(published[0], published[-1] + 1))  # no gap, nothing lost
    assert dlq_messages(k) == 0


class Publishing:
    """Steps the nodes continuously in a thread (a steady stream of batches) until stopped."""

    def __init__(self, *nodes: CoreNode, pause_s: float = 0.002) -> None:
        self.nodes = nodes
        self.pause_s = pause_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for node in self.nodes:
                    node.step()
                self._stop.wait(self.pause_s)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def __enter__(self) -> Publishing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise self.error
