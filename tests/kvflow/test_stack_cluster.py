"""`kvflow stack up --brokers 3`: a three-broker KRaft cluster of real processes on loopback, next
to the shared stack; a broker killed with SIGKILL mid-stream and restarted loses and doubles
nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from eventbus.config import KafkaSettings
from eventbus.kafka import ensure_topics
from kvflow.stack import (
    Kafka,
    KafkaCluster,
    Paths,
    Stack,
    StackSettings,
    free_port,
    pid_alive,
    port_open,
    project_dir,
)
from tests.reliability.exactness import Publishing, assert_exact
from tests.state_store.test_materializer import Recorder
from tests.support import CoreNode, applied_through, materializer, wait_for


def cluster_settings(home: Path, brokers: int = 3) -> StackSettings:
    return StackSettings(home=home, kafka_brokers=brokers, kafka_ports=[free_port() for _ in range(brokers)],
                         kafka_controller_ports=[free_port() for _ in range(brokers)], start_timeout_s=90)


def link_jars(home: Path) -> None:
    """The shared stack's jars (the same pom), instead of resolving them again."""
    (home / "kafka").mkdir(parents=True, exist_ok=True)
    (home / "kafka" / "libs").symlink_to(Stack(StackSettings()).paths.kafka_libs)


def test_a_cluster_broker_config_has_every_voter_three_replicas_and_two_in_sync(tmp_path):
    s = cluster_settings(tmp_path)
    paths = Paths(project=project_dir(), home=tmp_path)
    b = Kafka(paths, s, node_id=2, brokers=3)
    b.write_config()
    props = dict(ln.split("=", 1) for ln in b.conf.read_text().splitlines() if "=" in ln and not ln.startswith("#"))
    assert b.conf == tmp_path / "kafka" / "broker-2" / "server.properties"
    assert props["node.id"] == "2"
    assert props["listeners"] == f"PLAINTEXT://localhost:{s.kafka_ports[1]},CONTROLLER://localhost:{s.kafka_controller_ports[1]}"
    assert props["controller.quorum.voters"] == ",".join(
        f"{i + 1}@localhost:{p}" for i, p in enumerate(s.kafka_controller_ports))
    assert props["log.dirs"] == str(tmp_path / "kafka" / "broker-2" / "data")
    assert props["min.insync.replicas"] == "2" and props["default.replication.factor"] == "3"
    assert props["offsets.topic.replication.factor"] == "3" and props["transaction.state.log.min.isr"] == "2"
    # Default ports: 9092, 9094, 9096 (controllers 9093, 9095, 9097).
    assert [k.port for k in KafkaCluster(paths, StackSettings(home=tmp_path / "x", kafka_brokers=3)).brokers] \
        == [9092, 9094, 9096]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("cluster")
    link_jars(home)
    stack = Stack(cluster_settings(home))
    try:
        assert stack.kafka.up(lambda _m: None) == "started"
        stack.kafka.ensure_topics()
        yield stack
    finally:
        stack.kafka.down()


@pytest.mark.integration
def test_three_brokers_come_up_with_replicated_topics_and_status_shows_each(cluster):
    assert cluster.kafka.up(lambda _m: None) == "already running"
    status = cluster.status()
    brokers = [s for s in status if s.name.startswith("kafka")]
    assert [s.name for s in brokers] == ["kafka-1", "kafka-2", "kafka-3"]
    assert {s.state for s in brokers} == {"running"} and len({s.pid for s in brokers}) == 3
    admin = AdminClient({"bootstrap.servers": cluster.kafka.address})
    md = admin.list_topics(timeout=10)
    assert sorted(b.port for b in md.brokers.values()) == sorted(cluster.settings.kafka_ports)
    for topic in ("kv-events", "node-stats", "kv-events-dlq", "kv-control"):
        assert {len(p.replicas) for p in md.topics[topic].partitions.values()} == {3}, topic
    res = ConfigResource("topic", "kv-events")
    assert admin.describe_configs([res])[res].result()["min.insync.replicas"].value == "2"
    # `kvflow topics ensure` with its defaults: 3 replicas on a cluster of three (1 on one broker).
    own = KafkaSettings(bootstrap=cluster.kafka.address, events_topic=f"ev-auto-{time.time_ns()}")
    assert own.replication_factor == 0 and own.events_topic in ensure_topics(own)
    # ensure_topics waited until the broker its client asks knew the topic; the brokers this
    # client asks may learn it a moment later (each broker follows the KRaft metadata log on its
    # own, and librdkafka may send each metadata request to another broker): the check reads the
    # replicas from the same answer that lists the topic.
    def replica_counts() -> set[int] | None:
        topic = admin.list_topics(timeout=10).topics.get(own.events_topic)
        return {len(p.replicas) for p in topic.partitions.values()} if topic and topic.partitions else None

    assert wait_for(replica_counts, 10, what="the new topic in the metadata of the broker asked") == {3}


def _leader_of_busiest_partition(bootstrap: str, topic: str) -> int:
    """The broker leading the partition with the most messages (where the node publishes).

    The metadata and the offsets may come from brokers that follow the KRaft metadata log a moment
    apart: a "not leader" or "leader not available" answer (a fresh-clone run saw one) is asked
    again with fresh metadata, for up to 30 s."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    transient = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE}

    def attempt() -> tuple[int] | None:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "kvflow-test-leader"})
        try:
            md = c.list_topics(topic, timeout=10).topics[topic]
            sizes = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in md.partitions}
            return (md.partitions[max(sizes, key=lambda p: sizes[p])].leader,)
        except KafkaException as exc:
            if exc.args[0].code() in transient:
                return None
            raise
        finally:
            c.close()

    (leader,) = wait_for(attempt, 30, what="the leader of the busiest partition")
    return leader


@pytest.mark.integration
def test_a_broker_killed_mid_stream_and_restarted_loses_and_doubles_nothing(cluster, migrated_database_url, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    k = KafkaSettings(bootstrap=cluster.kafka.address, replication_factor=3, events_topic=f"ev-{suffix}",
                      stats_topic=f"st-{suffix}", dlq_topic=f"dlq-{suffix}", control_topic=f"ctl-{suffix}")
    ensure_topics(k)
    node = CoreNode(k, "node-c3", seed=3)
    rec = Recorder(node)
    mat = materializer(k, migrated_database_url, tmp_path).start()
    try:
        with Publishing(node):
            # Killed early, whatever the worker has done by then: it may still be joining its group
            # (finding the coordinator, its first offset lookups) or already applying.
            wait_for(lambda: node.publisher.batches_sent > 20, 60, interval=0.01, what="the node publishing")
            victim = next(b for b in cluster.kafka.brokers
                          if b.node_id == _leader_of_busiest_partition(k.bootstrap, k.events_topic))
            pid = victim.pid()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)  # the partition's leader, without warning
            wait_for(lambda: not pid_alive(pid), 10, what="the broker to die")
            # Delivered (acknowledged by the brokers left), not only made: the leader has moved.
            before = node.sink.delivered
            wait_for(lambda: node.sink.delivered > before + 40, 60, what="publishing on two brokers")
            assert cluster.kafka.up(lambda _m: None) == f"started broker(s) {victim.node_id}"
            restarted = node.sink.delivered
            wait_for(lambda: node.sink.delivered > restarted + 40, 60, what="publishing on three again")
        node.finish()
        wait_for(lambda: applied_through(migrated_database_url, node), 120, what="the materializer to catch up")
        assert mat.alive(), mat.tail()
        assert_exact(migrated_database_url, node, rec, k)
    finally:
        mat.stop()


@pytest.mark.integration
def test_stack_up_stopped_by_a_signal_leaves_no_broker_behind(tmp_path, kafka_bootstrap):
    home = tmp_path / "home"
    link_jars(home)
    s = cluster_settings(home)
    env = {**os.environ, "KVFLOW_STACK_HOME": str(home), "KVFLOW_STACK_KAFKA_PORTS": str(s.kafka_ports),
           "KVFLOW_STACK_KAFKA_CONTROLLER_PORTS": str(s.kafka_controller_ports),
           "KVFLOW_DATABASE_URL": "postgresql://unused@localhost:1/x"}  # only Kafka
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "stack", "up", "--brokers", "3"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cluster = KafkaCluster(Paths(project=project_dir(), home=home), s)
    try:
        wait_for(lambda: all(b.pid_file.is_file() for b in cluster.brokers), 60, interval=0.05,
                 what="the brokers to be spawned")
        pids = [int(b.pid_file.read_text()) for b in cluster.brokers]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode != 0 and "stopped by" in out, out
        time.sleep(0.2)
        assert not [p for p in pids if pid_alive(p)]
        assert not [p for p in s.kafka_ports if port_open(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.down()
