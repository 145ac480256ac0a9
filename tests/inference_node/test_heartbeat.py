"""Heartbeats do not wait for the engine: a node whose engine is held busy (a long prefill) stays
live in PostgreSQL, through real Kafka and a real materializer that marks silence as stale."""

from __future__ import annotations

import itertools
import time

import pytest

from eventbus.publisher import InMemorySink
from inference_node.node import NodeSettings, build_node
from tests.support import materializer, node_row, wait_for

pytestmark = pytest.mark.integration


def test_a_node_whose_engine_is_busy_longer_than_the_stale_timeout_stays_live(
        kafka_settings, migrated_database_url, tmp_path):
    mat = materializer(kafka_settings, migrated_database_url, tmp_path, KVFLOW_MATERIALIZER_STALE_AFTER_S="2").start()
    node = build_node(NodeSettings(node_id="hb-busy", model_preset="tiny", num_blocks=16, block_size=16,
                                   heartbeat_s=0.25, kafka=True), kafka_settings)
    try:
        wait_for(lambda: (row := node_row(migrated_database_url, "hb-busy")) is not None and row["status"] == "live",
                 60, what="the node to be live")
        # The engine thread is held for 3x the stale timeout, as a long prefill holds it.
        busy = node.engine.call(lambda: time.sleep(6.0))
        statuses = []
        while not busy.done():
            statuses.append(node_row(migrated_database_url, "hb-busy")["status"])
            time.sleep(0.25)
        assert len(statuses) >= 15 and set(statuses) == {"live"}, statuses
        assert node.engine.heartbeat.stale_sent >= 10  # beats sent while the engine could not answer
    finally:
        node.close()
        mat.stop()


def test_heartbeats_repeat_the_last_stats_while_the_engine_is_busy_and_resume_fresh_after():
    sink = InMemorySink()
    node = build_node(NodeSettings(node_id="hb-unit", model_preset="tiny", num_blocks=16, block_size=16,
                                   heartbeat_s=0.1, kafka=False), sink=sink)
    try:
        wait_for(lambda: len(sink.stats) >= 2, 10, what="the first heartbeats")
        before = len(sink.stats)
        node.engine.call(lambda: time.sleep(1.0)).result(5)
        during = sink.stats[before:]
        assert len(during) >= 5  # about one per 0.1 s, although the engine answered none
        last = sink.stats[before - 1]
        assert all(b.counters == last.counters and b.used == last.used for b in during)  # the last stats, repeated ...
        assert all(b2.ts > b1.ts for b1, b2 in itertools.pairwise(during))  # ... at the current time
        served = len(sink.stats)
        wait_for(lambda: len(sink.stats) >= served + 2, 5, what="fresh heartbeats again")
    finally:
        node.close()


def test_a_stopping_node_says_goodbye_with_a_last_heartbeat():
    sink = InMemorySink()
    node = build_node(NodeSettings(node_id="hb-bye", model_preset="tiny", num_blocks=16, block_size=16,
                                   heartbeat_s=0.1, kafka=False), sink=sink)
    wait_for(lambda: sink.stats, 10, what="a heartbeat")
    node.close()
    assert [b.status for b in sink.stats][-1] == "stopping"
    assert {b.status for b in sink.stats[:-1]} == {"live"}
    assert sink.stats[-1].last_event_id == node.core.last_event_id  # after the last events


def test_a_node_process_stopped_with_sigterm_publishes_its_goodbye(kafka_settings, tmp_path):
    from eventbus.kafka import make_consumer
    from eventbus.protocol import decode_stats
    from tests.inference_node.test_node_kafka import start_node

    proc, _ = start_node(kafka_settings, tmp_path, "node-bye")
    consumer = make_consumer(kafka_settings, group_id="t-node-bye")
    consumer.subscribe([kafka_settings.stats_topic])
    try:
        proc.stop()  # SIGTERM
        assert proc.proc is not None and proc.proc.returncode == 0
        beats = []
        deadline = time.monotonic() + 20
        while (not beats or beats[-1].status != "stopping") and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                beats.append(decode_stats(msg.value()))
        assert beats and beats[-1].node_id == "node-bye" and beats[-1].status == "stopping"
    finally:
        consumer.close()
