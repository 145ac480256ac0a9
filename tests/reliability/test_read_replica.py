"""Routers reading a PostgreSQL streaming standby (`kvflow stack up --replica`): they route from
it, measure its lag, and beyond KVFLOW_ROUTER_REPLICA_MAX_LAG_S read the primary (with
KVFLOW_ROUTER_PRIMARY_READER_URL) or flag the standby as stale (without).

A private primary and standby (own folder, own ports), so pausing replay touches nothing shared.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from fastapi.testclient import TestClient

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import to_sql
from kvflow.stack import Stack, StackSettings, free_port
from routing_api.app import create_app
from routing_api.config import RouterSettings
from state_store.config import plain_dsn
from tests.support import wait_for

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory, pg_owner_url: str) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("replica")
    stack = Stack(StackSettings(home=home, postgres_port=free_port(), replica=True, replica_port=free_port(),
                                start_timeout_s=90))
    stack.postgres.external_url = None
    bases = [stack.postgres.base, stack.replica.base]
    try:
        stack.postgres.up(lambda _m: None)
        from migrations import upgrade

        upgrade("head", url=stack.database_url)
        assert stack.replica.up(lambda _m: None) == "started"
        yield stack
    finally:
        stack.replica.down()
        stack.postgres.down()
        for b in bases:
            if not b.is_relative_to(home):
                shutil.rmtree(b, ignore_errors=True)


def primary_reader(stack: Stack) -> str:
    return f"postgresql+asyncpg://kvflow_reader:kvflow_reader@localhost:{stack.postgres.port}/kvflow"


def superuser_sql(stack: Stack, port: int, sql: str) -> str:
    """Run ``sql`` as the cluster's superuser (over its socket) on ``port``."""
    pg = stack.postgres
    out = subprocess.run(pg._as_pg([pg._bin("psql"), "-X", "-At", "-h", str(pg.sockets), "-p", str(port),
                                    "-U", "postgres", "-d", "kvflow", "-c", sql]),
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()


def put_node(url: str, node: str, tokens: list[int], blocks: int) -> None:
    """A live node holding the prompt's first ``blocks`` blocks (rows as the materializer writes them)."""
    async def run() -> None:
        now = datetime.now(tz=UTC)
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            await conn.execute(
                "INSERT INTO nodes (node_id, instance_id, status, url, model, block_size, capacity_gpu, last_seen)"
                " VALUES ($1, 'i', 'live', $2, 'm', 16, 1000, $3) ON CONFLICT (node_id) DO UPDATE SET last_seen = $3",
                node, f"http://{node}:1", now)
            await conn.execute("DELETE FROM node_blocks WHERE node_id = $1", node)
            hashes = [to_sql(h) for h in prompt_block_hashes(tokens, 16)][:blocks]
            await conn.copy_records_to_table(
                "node_blocks", columns=["node_id", "block_hash", "cache_level", "priority", "num_tokens",
                                        "stored_at", "updated_at"],
                records=[(node, h, 0, 35, 16, now, now) for h in hashes])
        finally:
            await conn.close()

    asyncio.run(run())


def replicated_to(stack: Stack, node: str) -> bool:
    return superuser_sql(stack, stack.replica.port, f"SELECT count(*) FROM nodes WHERE node_id = '{node}'") == "1"


def metric(c: TestClient, name: str) -> float:
    text = c.get("/metrics").text
    return next(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_the_standby_is_a_streaming_replica_in_recovery(replicated):
    assert (replicated.replica.data / "standby.signal").is_file()
    assert superuser_sql(replicated, replicated.replica.port, "SELECT pg_is_in_recovery()") == "t"
    status = {s.name: s for s in replicated.status()}
    assert status["postgres-replica"].state == "running" and status["postgres-replica"].pid
    assert replicated.reader_url.endswith(f"@localhost:{replicated.replica.port}/kvflow")
    assert superuser_sql(replicated, replicated.postgres.port,
                         "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") == "1"


@pytest.mark.parametrize("primary", [True, False], ids=["falls-back-to-the-primary", "flags-the-standby"])
def test_a_router_on_the_standby_routes_warm_and_notices_a_paused_replay(replicated, primary, tmp_path: Path):
    db = replicated.database_url
    tag = "p" if primary else "f"
    warm, later = f"warm-{tag}", f"later-{tag}"
    tokens = list(range(2000, 2064)) if primary else list(range(3000, 3064))  # 4 blocks of 16, each case its own
    put_node(db, warm, tokens, 2)
    wait_for(lambda: replicated_to(replicated, warm), 30, what="the standby to replay the warm node")
    settings = RouterSettings(nodes_cache_s=0.0, load_bound=0.0, replica_max_lag_s=1.0, replica_check_s=0.1,
                              primary_reader_url=primary_reader(replicated) if primary else None)
    with TestClient(create_app(settings, database_url=replicated.reader_url)) as c:
        wait_for(lambda: (c.get("/v1/stats").json()["replication"] or {}).get("standby"), 10, what="a lag check")
        assert c.post("/v1/route", json={"token_ids": tokens}).json()["node_id"] == warm
        rep = c.get("/v1/stats").json()["replication"]
        assert rep["reading"] == "reader" and not rep["stale"] and rep["lag_s"] < 1.0
        superuser_sql(replicated, replicated.replica.port, "SELECT pg_wal_replay_pause()")
        try:
            put_node(db, later, tokens, 4)  # on the primary only: a node holding the whole prompt
            rep = wait_for(lambda: (r := c.get("/v1/stats").json()["replication"])["stale"] and r, 15,
                           what="the router to notice the lag")
            assert rep["paused"] and rep["lag_s"] > 1.0 and rep["lag_bytes"] > 0
            assert metric(c, "kvflow_router_replica_lag_seconds") > 1.0
            assert metric(c, "kvflow_router_replica_stale") == 1.0
            chosen = c.post("/v1/route", json={"token_ids": tokens}).json()["node_id"]
            if primary:  # reads the primary: it sees the later node
                assert rep["reading"] == "primary" and chosen == later
                assert metric(c, "kvflow_router_reading_primary") == 1.0
                assert metric(c, "kvflow_router_replica_fallbacks_total") == 1.0
            else:  # reads the paused standby (flagged stale): the later node is not there yet
                assert rep["reading"] == "reader" and chosen == warm
                assert metric(c, "kvflow_router_reading_primary") == 0.0
        finally:
            superuser_sql(replicated, replicated.replica.port, "SELECT pg_wal_replay_resume()")
        rep = wait_for(lambda: not (r := c.get("/v1/stats").json()["replication"])["stale"] and r, 15,
                       what="the standby to catch up")
        assert rep["reading"] == "reader" and rep["lag_s"] < 1.0
        assert c.post("/v1/route", json={"token_ids": tokens}).json()["node_id"] == later


def test_a_standby_stopped_while_the_primary_writes_catches_up_from_its_slot(replicated):
    stack = replicated
    assert superuser_sql(stack, stack.replica.port, "SHOW primary_slot_name") == "kvflow_standby"
    assert superuser_sql(stack, stack.postgres.port, "SELECT active FROM pg_replication_slots"
                         " WHERE slot_name = 'kvflow_standby'") == "t"
    assert stack.replica.down().startswith("stopped")
    try:
        # WAL the standby has not received, in segments the primary would recycle without the slot
        # (a segment switch and a checkpoint after each write: the redo point moves past them).
        for i in range(3):
            put_node(stack.database_url, f"node-while-stopped-{i}", list(range(64)), 2)
            superuser_sql(stack, stack.postgres.port, "SELECT pg_switch_wal()")
            superuser_sql(stack, stack.postgres.port, "CHECKPOINT")
        assert superuser_sql(stack, stack.postgres.port, "SELECT active, wal_status FROM pg_replication_slots"
                             " WHERE slot_name = 'kvflow_standby'") in ("f|reserved", "f|extended")
    finally:
        assert stack.replica.up(lambda _m: None) == "started"
    wait_for(lambda: replicated_to(stack, "node-while-stopped-2"), 60, what="the standby to catch up")
    # NOTE: the walsender reports 'catchup' until the standby has received everything up to the
    # primary's current WAL position, and only then 'streaming': the rows can be replayed a moment
    # before that (CI saw 0 streaming right after the catch-up), so the state is waited for.
    wait_for(lambda: superuser_sql(stack, stack.postgres.port, "SELECT string_agg(state, ',')"
                                   " FROM pg_stat_replication") == "streaming", 30,
             what="the primary to report one walsender streaming")
