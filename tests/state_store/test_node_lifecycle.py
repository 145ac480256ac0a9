"""A node's life as a real materializer process sees it, over real Kafka and PostgreSQL: a lost
resync request is asked again, a node that says goodbye is gone at once, a long-gone node's row
is pruned (its history stays) and the node, back, is a new one."""

from __future__ import annotations

import time
import uuid

import pytest

from eventbus import protocol as p
from eventbus.kafka import make_consumer
from tests.state_store.test_materializer import Recorder, expected_history_rows
from tests.support import (
    CoreNode,
    applied_through,
    fetch,
    materializer,
    node_row,
    send_heartbeat,
    sql_blocks,
    wait_for,
)

pytestmark = pytest.mark.integration


def history_rows(url: str, node_id: str) -> int:
    return fetch(url, "SELECT count(*) AS c FROM block_events WHERE node_id = $1", node_id)[0]["c"]


def status(url: str, node_id: str) -> str | None:
    row = node_row(url, node_id)
    return row["status"] if row else None


def test_a_lost_resync_request_is_asked_again_until_the_node_answers(kafka_settings, migrated_database_url,
                                                                     tmp_path):
    db = migrated_database_url
    node = CoreNode(kafka_settings, "node-r", seed=9)
    # The node's control topic, read from the start: the test plays the node's listener.
    control = make_consumer(kafka_settings, group_id=f"t-control-{uuid.uuid4().hex[:8]}")
    control.subscribe([kafka_settings.control_topic])
    mat = materializer(kafka_settings, db, tmp_path, KVFLOW_MATERIALIZER_RESYNC_RETRY_S="1",
                       KVFLOW_MATERIALIZER_STALE_AFTER_S="120").start()
    commands: list[p.ControlCommand] = []

    def next_command() -> bool:
        msg = control.poll(0.5)
        if msg is None or msg.error() is not None or msg.key() != b"node-r":
            return False
        commands.append(p.decode_control(msg.value()))
        return True

    try:
        node.run(60)
        node.finish()
        wait_for(lambda: applied_through(db, node), 60, what="the stream")
        # A batch is lost on the way: a gap, and the materializer asks for a snapshot.
        send, lost = node.sink.send_batch, []
        node.sink.send_batch = lost.append  # type: ignore[method-assign]
        while not lost:
            node.step()
        node.sink.send_batch = send  # type: ignore[method-assign]
        node.run(20)
        node.finish()
        wait_for(lambda: status(db, "node-r") == "resyncing", 60, what="the gap")
        wait_for(next_command, 30, what="a resync request")
        assert (commands[0].command, commands[0].reason) == ("resync", "event_id gap")
        # The node never reads that one (its listener was not reading yet): asked again.
        wait_for(next_command, 30, what="the resync request asked again")
        assert (commands[1].command, commands[1].reason) == ("resync", "still resyncing: request 2")
        # It answers this one: healed, exact, and the requests stop.
        node.core.request_snapshot()
        node.finish()
        wait_for(lambda: applied_through(db, node), 60, what="the snapshot")
        assert sql_blocks(db, "node-r") == node.truth()
        assert node_row(db, "node-r")["resync_attempts"] == 0
    finally:
        control.close()
        mat.stop()


def test_a_node_that_says_goodbye_is_gone_at_once_and_its_late_events_are_history(kafka_settings,
                                                                                  migrated_database_url, tmp_path):
    db = migrated_database_url
    node = CoreNode(kafka_settings, "node-g", seed=4)
    mat = materializer(kafka_settings, db, tmp_path, KVFLOW_MATERIALIZER_STALE_AFTER_S="120").start()
    try:
        node.run(60)
        node.finish()
        send_heartbeat(node)
        wait_for(lambda: applied_through(db, node) and node_row(db, "node-g")["last_stats_at"] is not None, 60,
                 what="the node live")
        assert sql_blocks(db, "node-g")
        history = history_rows(db, "node-g")

        t0 = time.monotonic()
        send_heartbeat(node, "stopping")
        wait_for(lambda: status(db, "node-g") == "gone", 10, interval=0.05, what="the node gone")
        print(f"gone {time.monotonic() - t0:.2f} s after its goodbye")
        row = node_row(db, "node-g")
        assert row["stopped_at"] is not None
        assert sql_blocks(db, "node-g") == {}
        assert history_rows(db, "node-g") == history  # its history stays

        # Its last events, consumed after the goodbye: recorded, not applied; it stays gone.
        node.run(30)
        node.finish()
        wait_for(lambda: node_row(db, "node-g")["last_event_id"] == node.core.last_event_id, 30,
                 what="the late events")
        assert status(db, "node-g") == "gone" and sql_blocks(db, "node-g") == {}
        assert history_rows(db, "node-g") > history
        assert mat.alive(), mat.tail()
    finally:
        mat.stop()


def test_a_long_gone_nodes_row_is_pruned_its_history_stays_and_back_it_is_a_new_node(
        kafka_settings, migrated_database_url, tmp_path):
    db = migrated_database_url
    node = CoreNode(kafka_settings, "node-p", seed=2)
    rec = Recorder(node)
    mat = materializer(kafka_settings, db, tmp_path, KVFLOW_MATERIALIZER_STALE_AFTER_S="1",
                       KVFLOW_MATERIALIZER_GONE_AFTER_S="1", KVFLOW_MATERIALIZER_PRUNE_GONE_AFTER_S="2").start()
    try:
        node.run(40)
        node.finish()
        wait_for(lambda: node_row(db, "node-p") is not None, 60, what="the node")
        # Silent: stale after 1 s, gone after 1 s more, its row deleted 2 s later.
        wait_for(lambda: node_row(db, "node-p") is None and history_rows(db, "node-p") == expected_history_rows(
            rec.events), 60, what="the row pruned, the history whole")
        pruned_at = fetch(db, "SELECT now() AS t")[0]["t"]
        assert fetch(db, "SELECT count(*) AS c FROM node_blocks WHERE node_id = 'node-p'")[0]["c"] == 0

        # Back, as a new instance: a new node (it heartbeats, as a running node does).
        back = CoreNode(kafka_settings, "node-p", seed=3)
        back.run(30)
        back.finish()
        wait_for(lambda: send_heartbeat(back) or applied_through(db, back), 60, what="the node back")
        assert sql_blocks(db, "node-p") == back.truth()
        assert node_row(db, "node-p")["first_seen"] > pruned_at
        instances = fetch(db, "SELECT DISTINCT instance_id FROM block_events WHERE node_id = 'node-p'")
        assert {r["instance_id"] for r in instances} == {node.instance_id, back.instance_id}
    finally:
        mat.stop()
