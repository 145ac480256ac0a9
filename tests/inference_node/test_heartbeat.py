"""Heartbeats do not wait for the engine: a node whose engine is held busy (a long prefill) stays
live in PostgreSQL, through real Kafka and a real materializer that marks silence as stale."""

from __future__ import annotations

import time

import pytest

from inference_node.node import NodeSettings, build_node
from inference_node.publisher import InMemorySink
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
        assert all(b2.ts > b1.ts for b1, b2 in zip(during, during[1:], strict=False))  # ... at the current time
        served = len(sink.stats)
        wait_for(lambda: len(sink.stats) >= served + 2, 5, what="fresh heartbeats again")
    finally:
        node.close()
