"""`kvflow events tail`: a second, independent consumer group, live lines and counts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from confluent_kafka import Producer

from eventbus import protocol as p
from kvflow.tail import describe, tail
from tests.support import ROOT, CoreNode, kafka_env


def test_describe_formats_each_kind():
    b = p.EventBatch(schema_version=1, node_id="node-a", instance_id="0123456789", ts=1.0, events=[])
    lines = [describe(b, p.Event(event_id=i, window_size=1, data=d)) for i, d in enumerate([
        p.Created(num_blocks_per_cache_level=[8, 2]),
        p.Stored(parent_hash=None, blocks=[p.StoredBlock(block_hash=255, num_tokens=4, priority=100)]),
        p.Updated(block_hash=255, cache_level=p.LevelDiff(old=0, new=1)),
        p.Removed(block_hashes=[255]),
        p.Snapshot(blocks=[]),
    ])]
    assert lines == [
        "node-a 01234567 #0      created  capacity=[8, 2]",
        "node-a 01234567 #1      stored      1 blocks  parent=- first=00000000000000ff priority=100",
        "node-a 01234567 #2      updated  00000000000000ff level 0->1",
        "node-a 01234567 #3      removed     1 blocks  first=00000000000000ff",
        "node-a 01234567 #4      snapshot    0 blocks",
    ]


@pytest.mark.integration
def test_tail_reads_every_event_in_its_own_group(kafka_settings):
    node = CoreNode(kafka_settings, "node-t", seed=1)
    node.run(40)
    node.finish()
    producer = Producer({"bootstrap.servers": kafka_settings.bootstrap})
    producer.produce(kafka_settings.events_topic, b"garbage")
    assert producer.flush(10) == 0
    lines: list[str] = []
    summary = tail(kafka_settings, from_beginning=True, idle_timeout_s=5, emit=lines.append)
    assert sum(summary.events.values()) == node.core.last_event_id + 1
    assert summary.bad == 1
    assert any(" created " in ln for ln in lines) and lines[-1].startswith("-- ")

    # The CLI, as a user runs it, in a fresh group: the same events again.
    proc = subprocess.run([sys.executable, "-m", "kvflow.cli", "events", "tail", "--from-beginning",
                           "--limit", "5"], env={**kafka_env(kafka_settings), "PATH": "/usr/bin:/bin",
                                                 "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    # The garbage message went to another partition; whether its "!!" line comes before the node's
    # events depends on the order partitions are fetched in, so look at the node's lines.
    events = [ln for ln in out if "node-t" in ln]
    assert len(events) == 5 and "#0      created" in events[0]
    assert all(ln.startswith(("node-t", "!! bad message", "-- ")) for ln in out), out
