"""Faults against the real stack. The invariant after recovery: PostgreSQL's node_blocks equals
every node's /v1/kv/state, and block_events holds no duplicate.

Each test that breaks a service breaks one of its own (a private broker or cluster on free ports,
in the test's folder), so the shared local stack keeps serving the rest of the suite.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from eventbus import protocol as p
from eventbus.config import KafkaSettings
from eventbus.kafka import ensure_topics
from eventbus.replay import NodeState
from kvflow.stack import Kafka, Paths, StackSettings, project_dir
from routing_api.app import create_app
from routing_api.config import RouterSettings
from tests.inference_node.test_node_kafka import start_node
from tests.support import (
    TcpProxy,
    fetch,
    free_port,
    history_duplicates,
    materializer,
    node_row,
    private_postgres,
    sql_blocks,
    wait_for,
)

pytestmark = pytest.mark.integration


def node_truth(url: str) -> tuple[str, int, dict]:
    state = httpx.get(f"{url}/v1/kv/state", timeout=10).json()
    return state["instance_id"], state["last_event_id"], NodeState.from_snapshot_blocks(
        p.SnapshotBlock(**b) for b in state["blocks"])


def converged(db: str, node_id: str, url: str) -> bool:
    inst, last, blocks = node_truth(url)
    row = node_row(db, node_id)
    return (row is not None and row["instance_id"] == inst and row["last_event_id"] == last
            and row["status"] == "live" and sql_blocks(db, node_id) == blocks)


def traffic(url: str, n: int, tag: str, *, max_tokens: int = 2) -> int:
    ok = 0
    for i in range(n):
        body = {"prompt": f"{tag} shared context. " * 6 + f"request {i}", "max_tokens": max_tokens,
                "kv_retention": {"token_ranges": [{"start": 0, "end": 64, "priority": 100 if i % 2 else 20}]}}
        ok += httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    return ok


class PrivateKafka(Kafka):
    """A broker of the test's own, optionally with a second listener reached through a proxy."""

    def __init__(self, home: Path, proxy_for_external: bool = False) -> None:
        settings = StackSettings(home=home, kafka_port=free_port(), kafka_controller_port=free_port(),
                                 start_timeout_s=90)
        super().__init__(Paths(project=project_dir(), home=home), settings)
        # Reuse the jars the main stack resolved, if any (they are the same pom).
        main_libs = project_dir() / ".kvflow" / "kafka" / "libs"
        if main_libs.is_dir() and not self.paths.kafka_libs.exists():
            shutil.copytree(main_libs, self.paths.kafka_libs)
        self.external_port = free_port() if proxy_for_external else None
        self.proxy: TcpProxy | None = None
        if proxy_for_external:
            self.proxy_port = free_port()

    def write_config(self) -> None:
        super().write_config()
        if self.external_port is None:
            return
        s = self.settings
        lines = [ln for ln in self.paths.kafka_conf.read_text().splitlines()
                 if not ln.startswith(("listeners=", "advertised.listeners=", "listener.security.protocol.map=",
                                       "inter.broker.listener.name="))]
        lines += [
            f"listeners=PLAINTEXT://localhost:{s.kafka_port},EXTERNAL://localhost:{self.external_port},"
            f"CONTROLLER://localhost:{s.kafka_controller_port}",
            f"advertised.listeners=PLAINTEXT://localhost:{s.kafka_port},EXTERNAL://localhost:{self.proxy_port}",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,EXTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name=PLAINTEXT",
        ]
        self.paths.kafka_conf.write_text("\n".join(lines) + "\n")

    def start(self) -> KafkaSettings:
        self.up(lambda _m: None)
        if self.external_port is not None and self.proxy is None:
            self.proxy = TcpProxy(self.external_port, self.proxy_port)
        suffix = uuid.uuid4().hex[:6]
        k = KafkaSettings(bootstrap=self.address, events_topic=f"ev-{suffix}", stats_topic=f"st-{suffix}",
                          dlq_topic=f"dlq-{suffix}", control_topic=f"ctl-{suffix}")
        ensure_topics(k)
        return k

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.down()


@pytest.fixture
def private_kafka(tmp_path, kafka_bootstrap):
    broker = PrivateKafka(tmp_path / "kafka-home")
    yield broker
    broker.close()


def test_kafka_broker_stopped_and_restarted_under_load(private_kafka, migrated_database_url, tmp_path):
    k = private_kafka.start()
    mat = materializer(k, migrated_database_url, tmp_path)
    mat.start()
    node, url = start_node(k, tmp_path, "node-kr", num_blocks="24", host_blocks="8", block_size="16")
    try:
        assert traffic(url, 10, "before") == 10
        wait_for(lambda: converged(migrated_database_url, "node-kr", url), 60, what="first convergence")

        private_kafka.down()  # the broker goes away: the node must keep serving
        assert traffic(url, 25, "during") == 25
        private_kafka.up(lambda _m: None)
        assert traffic(url, 5, "after") == 5
        wait_for(lambda: converged(migrated_database_url, "node-kr", url), 120, what="convergence after the outage")
        assert history_duplicates(migrated_database_url, "node-kr") == 0
    finally:
        node.stop()
        mat.stop()


def test_node_cut_off_from_kafka_publishes_a_snapshot_on_reconnect(tmp_path, kafka_bootstrap, migrated_database_url):
    broker = PrivateKafka(tmp_path / "kafka-home", proxy_for_external=True)
    try:
        k = broker.start()
        node_kafka = k.model_copy(update={"bootstrap": f"localhost:{broker.proxy_port}"})
        mat = materializer(k, migrated_database_url, tmp_path).start()
        # Few undelivered batches in flight and a small event queue: the outage overflows it.
        node, url = start_node(node_kafka, tmp_path, "node-cut", env={"KVFLOW_NODE_MAX_INFLIGHT_BATCHES": "3",
                                                                      "KVFLOW_NODE_MAX_QUEUED_EVENTS": "40"},
                               num_blocks="24", block_size="16")
        try:
            assert traffic(url, 6, "before") == 6
            wait_for(lambda: converged(migrated_database_url, "node-cut", url), 60, what="first convergence")
            assert broker.proxy is not None
            broker.proxy.cut()  # only the node loses Kafka; the materializer keeps its own connection
            assert traffic(url, 30, "cut off") == 30
            stats = httpx.get(f"{url}/v1/kv/stats", timeout=10).json()
            assert stats["pending_events"] > 0 or stats["kv"]["events_overflowed"] > 0
            broker.proxy.restore()


            def snapshots() -> int:
                return int(fetch(migrated_database_url, "SELECT count(DISTINCT event_id) AS n FROM block_events "
                                                        "WHERE node_id = 'node-cut' AND kind = 'snapshot'")[0]["n"])

            # Converged *with* the snapshot owed for the loss (the start-up one, and the one after it): until
            # the node drains that snapshot its last event id is the last one it delivered, so the database can
            # look converged a moment before the snapshot lands (seen once in a fresh clone's run).
            wait_for(lambda: snapshots() >= 2 and converged(migrated_database_url, "node-cut", url), 120,
                     what="the snapshot after the loss, and convergence")
            overflowed = httpx.get(f"{url}/v1/kv/stats", timeout=10).json()["kv"]["events_overflowed"]
            assert overflowed > 0 and snapshots() >= 2
            assert history_duplicates(migrated_database_url, "node-cut") == 0
        finally:
            node.stop()
            mat.stop()
    finally:
        broker.close()


def test_postgres_stopped_and_restarted_the_materializer_waits_and_loses_nothing(kafka_settings, tmp_path):
    with private_postgres(tmp_path) as pg:
        db = f"postgresql+asyncpg://kvflow:kvflow@localhost:{pg.port}/kvflow"
        from migrations import upgrade

        upgrade("head", url=db)
        mat = materializer(kafka_settings, db, tmp_path, KVFLOW_MATERIALIZER_STALE_AFTER_S="60")
        mat.start()
        node, url = start_node(kafka_settings, tmp_path, "node-pg", num_blocks="24", block_size="16")
        try:
            assert traffic(url, 8, "before") == 8
            wait_for(lambda: converged(db, "node-pg", url), 60, what="first convergence")
            pg.down()
            assert traffic(url, 20, "while PostgreSQL is down") == 20
            assert mat.alive(), mat.tail()
            pg.up(lambda _m: None)
            wait_for(lambda: converged(db, "node-pg", url), 120, what="convergence after the restart")
            assert history_duplicates(db, "node-pg") == 0
            assert "database unavailable" in mat.tail(200)
        finally:
            node.stop()
            mat.stop()


def test_a_killed_node_goes_stale_is_avoided_is_cleared_and_restarts_clean(
        kafka_settings, migrated_database_url, reader_url, tmp_path):
    mat = materializer(kafka_settings, migrated_database_url, tmp_path, KVFLOW_MATERIALIZER_STALE_AFTER_S="2",
                       KVFLOW_MATERIALIZER_GONE_AFTER_S="5").start()
    a, url_a = start_node(kafka_settings, tmp_path, "node-x", num_blocks="64")
    b, _url_b = start_node(kafka_settings, tmp_path, "node-y", num_blocks="64")
    router = TestClient(create_app(RouterSettings(nodes_cache_s=0.0), database_url=reader_url))
    try:
        with router:
            prompt = "the prompt node-x holds. " * 8
            assert httpx.post(f"{url_a}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                              timeout=30).status_code == 200
            wait_for(lambda: converged(migrated_database_url, "node-x", url_a), 60, what="node-x in SQL")
            assert router.post("/v1/route", json={"prompt": prompt}).json()["node_id"] == "node-x"

            a.kill9()
            wait_for(lambda: node_row(migrated_database_url, "node-x")["status"] == "stale", 20, what="stale")
            decision = router.post("/v1/route", json={"prompt": prompt}).json()
            assert decision["node_id"] == "node-y"
            assert {c["node_id"]: c["eligible"] for c in decision["candidates"]}["node-x"] is False

            wait_for(lambda: node_row(migrated_database_url, "node-x")["status"] == "gone", 30, what="gone")
            assert sql_blocks(migrated_database_url, "node-x") == {}

            a2, url_a2 = start_node(kafka_settings, tmp_path, "node-x", num_blocks="64")
            try:
                wait_for(lambda: converged(migrated_database_url, "node-x", url_a2), 60, what="the new instance")
                assert sql_blocks(migrated_database_url, "node-x") == {}  # it starts clean
                assert node_row(migrated_database_url, "node-x")["instance_id"] != ""
            finally:
                a2.stop()
    finally:
        b.stop()
        mat.stop()
