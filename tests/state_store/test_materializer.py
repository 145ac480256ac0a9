"""The materializer against real Kafka and real PostgreSQL."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from confluent_kafka import Producer

import state_store.native
from eventbus import protocol as p
from eventbus.kafka import make_consumer
from kvflow.stack import free_port
from tests.support import (
    CoreNode,
    TcpProxy,
    applied_through,
    fetch,
    history_duplicates,
    materializer,
    node_row,
    sql_blocks,
    wait_for,
)

pytestmark = pytest.mark.integration


def expected_history_rows(events: list[p.Event]) -> int:
    n = 0
    for e in events:
        d = e.data
        if isinstance(d, p.Stored | p.Snapshot):
            n += max(1, len(d.blocks))
        elif isinstance(d, p.Removed):
            n += len(d.block_hashes)
        else:
            n += 1
    return n


class Recorder:
    """Wraps a node's sink to remember every event it published (for exact history counts)."""

    def __init__(self, node: CoreNode) -> None:
        self.events: list[p.Event] = []
        send = node.sink.send_batch

        def record(batch: p.EventBatch) -> None:
            self.events.extend(batch.events)
            send(batch)

        node.sink.send_batch = record  # type: ignore[method-assign]


def takes(port: int) -> dict[str, float]:
    """kvflow_materializer_takes_total by planner, from the worker's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvflow_materializer_takes_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


@pytest.mark.parametrize("planner", ["native", "python"])
def test_random_workloads_of_three_nodes_materialize_exactly(kafka_settings, migrated_database_url, tmp_path,
                                                             planner):
    if planner == "native" and not state_store.native.available():
        pytest.skip("kvflow_native is not installed (its own tests say whether it must be)")
    # node-2 sends its snapshots in parts of 3 blocks, and is asked for one every 40 steps.
    nodes = [CoreNode(kafka_settings, f"node-{i}", seed=i, snapshot_part_blocks=3 if i == 2 else 16_384)
             for i in range(3)]
    recs = [Recorder(n) for n in nodes]
    port = free_port()
    mat = materializer(kafka_settings, migrated_database_url, tmp_path, KVFLOW_MATERIALIZER_WEB_PORT=str(port),
                       KVFLOW_MATERIALIZER_NATIVE=str(planner == "native").lower()).start()
    try:
        for step in range(300):
            for n in nodes:
                n.step()
            if step % 40 == 39:
                nodes[2].core.request_snapshot()
        for n in nodes:
            n.finish()
        wait_for(lambda: all(applied_through(migrated_database_url, n) for n in nodes), 90,
                 what="the materializer to catch up")
        for n, rec in zip(nodes, recs, strict=True):
            assert sql_blocks(migrated_database_url, n.node_id) == n.truth()
            assert history_duplicates(migrated_database_url, n.node_id) == 0
            rows = fetch(migrated_database_url, "SELECT count(*) AS c FROM block_events WHERE node_id = $1",
                         n.node_id)[0]["c"]
            assert rows == expected_history_rows(rec.events)
        parts = [e.data.parts for e in recs[2].events if isinstance(e.data, p.Snapshot)]
        assert max(parts) > 3  # multi-part snapshots were really sent
        row = node_row(migrated_database_url, "node-0")
        assert row["capacity_gpu"] == 24 and row["capacity_host"] == 16 and row["window_size"] == 64
        by = takes(port)
        if planner == "native":  # the hot path planned takes (alone, or with the reference planner)
            assert by.get("compiled", 0) + by.get("parts", 0) > 0, by
        else:
            assert by.get("python", 0) > 0 and by.get("compiled", 0) == by.get("parts", 0) == 0, by
    finally:
        mat.stop()


def test_kill_9_mid_stream_then_restart_loses_and_duplicates_nothing(kafka_settings, migrated_database_url, tmp_path):
    node = CoreNode(kafka_settings, "node-k", seed=42)
    rec = Recorder(node)
    group = "mat-kill9"
    mat = materializer(kafka_settings, migrated_database_url, tmp_path, group=group).start()
    node.run(400)
    node.publisher.pump()
    node.sink.flush(30)
    # Let it get part of the way, then kill it without warning.
    wait_for(lambda: (node_row(migrated_database_url, "node-k") or {}).get("last_event_id", -1) > 50, 60,
             what="some progress")
    mat.kill9()
    node.run(400)
    node.finish()
    mat = materializer(kafka_settings, migrated_database_url, tmp_path, group=group).start()
    try:
        wait_for(lambda: applied_through(migrated_database_url, node), 120, what="catch-up after restart")
        assert sql_blocks(migrated_database_url, "node-k") == node.truth()
        assert history_duplicates(migrated_database_url, "node-k") == 0
        rows = fetch(migrated_database_url, "SELECT count(*) AS c FROM block_events WHERE node_id = 'node-k'")
        assert rows[0]["c"] == expected_history_rows(rec.events)
    finally:
        mat.stop()


def test_duplicated_reordered_and_gapped_batches_and_a_restart(kafka_settings, migrated_database_url, tmp_path):
    node = CoreNode(kafka_settings, "node-d", seed=7)
    held: list[p.EventBatch] = []
    send = node.sink.send_batch
    node.sink.send_batch = held.append  # type: ignore[method-assign]
    node.run(200)
    node.finish()
    assert len(held) > 10
    mat = materializer(kafka_settings, migrated_database_url, tmp_path).start()
    try:
        # Every batch twice, and two neighbours swapped: a gap (then a duplicate of the past).
        order = list(range(len(held)))
        order[5], order[6] = order[6], order[5]
        for i in order:
            send(held[i])
            send(held[i])
        node.sink.flush(30)
        row = wait_for(lambda: (r := node_row(migrated_database_url, "node-d")) and
                       r["last_event_id"] == node.core.last_event_id and r, 60, what="all batches")
        # The swap left a gap: the node was asked for a snapshot, and until it answers, it resyncs.
        assert row["status"] == "resyncing" and row["resync_requested_at"] is not None
        consumer = make_consumer(kafka_settings, group_id="t-control")
        consumer.subscribe([kafka_settings.control_topic])
        cmd = wait_for(lambda: consumer.poll(0.5), 30, what="a resync command")
        consumer.close()
        assert cmd.key() == b"node-d"
        assert p.decode_control(cmd.value()).command == "resync"
        # The node answers with a snapshot: healed and exact.
        node.sink.send_batch = send  # type: ignore[method-assign]
        node.core.request_snapshot()
        node.finish()
        wait_for(lambda: applied_through(migrated_database_url, node), 60, what="the snapshot")
        assert sql_blocks(migrated_database_url, "node-d") == node.truth()
        assert history_duplicates(migrated_database_url, "node-d") == 0

        # The node restarts: a new instance starts clean, and the old instance's state is gone.
        restarted = CoreNode(kafka_settings, "node-d", seed=8)
        restarted.run(50)
        restarted.finish()
        wait_for(lambda: applied_through(migrated_database_url, restarted), 60, what="the new instance")
        assert sql_blocks(migrated_database_url, "node-d") == restarted.truth()
    finally:
        mat.stop()


def test_malformed_messages_go_to_the_dlq_and_good_ones_around_them_are_applied(
        kafka_settings, migrated_database_url, tmp_path):
    node = CoreNode(kafka_settings, "node-m", seed=3)
    producer = Producer({"bootstrap.servers": kafka_settings.bootstrap})
    bad = {
        b"{not json": "malformed_json",
        json.dumps({"schema_version": 9, "node_id": "node-m", "instance_id": "x", "ts": 1, "events": []}).encode():
            "unknown_schema_version",
        json.dumps({"schema_version": 1, "node_id": "node-m", "instance_id": "x", "ts": "soon",
                    "events": []}).encode(): "invalid",
    }
    mat = materializer(kafka_settings, migrated_database_url, tmp_path).start()
    try:
        node.run(60)
        node.publisher.pump()
        node.sink.flush(30)
        for raw in bad:
            producer.produce(kafka_settings.events_topic, key=b"node-m", value=raw)
        producer.produce(kafka_settings.events_topic, key=b"node-x", value=p.encode(
            p.EventBatch(schema_version=1, node_id="node-m", instance_id="i", ts=1.0,
                         events=[p.Event(event_id=0, window_size=1, data=p.Snapshot(blocks=[]))])))
        producer.flush(10)
        node.run(60)
        node.finish()
        wait_for(lambda: applied_through(migrated_database_url, node), 60, what="the good batches")
        assert sql_blocks(migrated_database_url, "node-m") == node.truth()

        consumer = make_consumer(kafka_settings, group_id="t-dlq")
        consumer.subscribe([kafka_settings.dlq_topic])
        got: dict[bytes, dict[str, bytes]] = {}
        deadline = time.monotonic() + 30
        while len(got) < 4 and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got[msg.value()] = dict(msg.headers())
        consumer.close()
        assert len(got) == 4
        for raw, reason in bad.items():
            assert got[raw]["kvflow-error-reason"] == reason.encode()
            assert got[raw]["kvflow-source-topic"] == kafka_settings.events_topic.encode()
        mismatched = [h for h in got.values() if h["kvflow-error-reason"] == b"key_mismatch"]
        assert len(mismatched) == 1
    finally:
        mat.stop()


def test_the_worker_consumer_fetches_with_the_configured_wait(kafka_settings, migrated_database_url, monkeypatch):
    """faust hard-codes a 1.5 s fetch wait; the worker's consumer starts its fetcher with ours."""
    import asyncio

    from state_store.config import DatabaseSettings, MaterializerSettings
    from state_store.faust_app import build_app

    monkeypatch.setenv("KVFLOW_DATABASE_URL", migrated_database_url)
    app = build_app(kafka_settings, DatabaseSettings(),
                    MaterializerSettings(web_port=0, fetch_max_wait_ms=77, group_id=f"fetch-{time.time_ns()}"))

    thread = app.consumer._thread  # not started: only its consumer is made and started here

    async def started_fetcher_wait() -> int:
        consumer = thread._create_worker_consumer(app.transport)
        await consumer.start()
        try:
            return int(consumer._fetcher._fetch_max_wait_ms)
        finally:
            await consumer.stop()

    try:
        assert asyncio.run(started_fetcher_wait()) == 77
    finally:
        thread.thread_loop.close()


def test_the_workers_producer_is_idempotent(kafka_settings, migrated_database_url, monkeypatch):
    """faust has no idempotence setting: the DLQ's and kv-control's producer gets aiokafka's (acks=all),
    and a started one takes a producer id from the broker."""
    import asyncio

    from state_store.config import DatabaseSettings, MaterializerSettings
    from state_store.faust_app import build_app

    monkeypatch.setenv("KVFLOW_DATABASE_URL", migrated_database_url)
    app = build_app(kafka_settings, DatabaseSettings(), MaterializerSettings(web_port=0))

    async def started_producer_id() -> int:
        aio = app.transport.create_producer()._new_producer()
        await aio.start()
        try:
            await aio.send_and_wait(kafka_settings.control_topic, b"", key=b"idempotence-check")
            return int(aio._txn_manager.producer_id)  # -1 without idempotence
        finally:
            await aio.stop()

    assert asyncio.run(started_producer_id()) >= 0


def test_healthz_answers_503_while_the_database_is_unreachable_and_200_when_it_is_back(
        kafka_settings, migrated_database_url, tmp_path):
    from sqlalchemy.engine import make_url

    db = make_url(migrated_database_url)
    assert db.port is not None
    proxy = TcpProxy(db.port)  # the worker's only way to PostgreSQL
    port = free_port()
    mat = materializer(kafka_settings, db.set(port=proxy.port).render_as_string(hide_password=False), tmp_path,
                       KVFLOW_MATERIALIZER_WEB_PORT=str(port)).start()

    def health(status: int) -> dict | None:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == status else None

    try:
        def serving() -> dict | None:  # 200 "standby" comes first, until the group assigns partitions
            body = health(200)
            return body if body is not None and body["status"] != "standby" else None

        body = wait_for(serving, 60, what="a healthy worker with partitions")
        assert body["status"] == "ok" and body["db_ok"] is True and body["reason"] is None
        assert body["partitions_assigned"] > 0 and body["group_id"].startswith("mat-")
        proxy.cut()
        body = wait_for(lambda: health(503), 30, what="503 without the database")
        assert body["status"] == "unavailable" and body["db_ok"] is False
        assert body["reason"].startswith("database unreachable"), body
        assert body["partitions_assigned"] > 0  # Kafka is fine
        proxy.restore()
        body = wait_for(lambda: health(200), 30, what="200 with the database back")
        assert body["db_ok"] is True
        assert mat.alive(), mat.tail()
    finally:
        mat.stop()
        proxy.close()
