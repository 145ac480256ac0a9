"""Fuzzing the node's and the router's OpenAPI with schemathesis: no 5xx, no hang.

Both run as real processes (a node without Kafka; a router over a fresh database where that node
is registered live), and schemathesis generates requests from their own /openapi.json.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from kvflow.bench.scratch import drop_database, with_database
from state_store.config import DatabaseSettings, plain_dsn
from tests.conftest import service_missing
from tests.support import ServiceProcess, free_port, http_ok, wait_for

pytestmark = pytest.mark.integration

FUZZ = settings(max_examples=int(os.environ.get("KVFLOW_FUZZ_EXAMPLES", "30")), deadline=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def node_url(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    proc = ServiceProcess(["node", "--node-id", "fuzz-node", "--port", str(port), "--no-kafka", "--model-preset",
                           "tiny", "--num-blocks", "64", "--log-level", "warning"], {},
                          tmp_path_factory.mktemp("fuzz") / "node.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{url}/healthz"), 60, what="the node")
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def router_url(node_url, tmp_path_factory) -> Iterator[str]:
    owner = DatabaseSettings().writer()
    name = "kvflow_fuzz_" + uuid.uuid4().hex[:10]

    async def create() -> None:
        conn = await asyncpg.connect(plain_dsn(owner), timeout=5)
        try:
            await conn.execute(f'CREATE DATABASE "{name}" OWNER kvflow')
        finally:
            await conn.close()

    try:
        asyncio.run(create())
    except Exception as exc:
        service_missing("PostgreSQL", exc)
    url = with_database(owner, name)
    from migrations import upgrade

    upgrade("head", url=url)

    async def register() -> None:
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            await conn.execute("INSERT INTO nodes (node_id, instance_id, status, url, model, block_size, capacity_gpu,"
                               " last_seen) VALUES ('fuzz-node', 'i', 'live', $1, 'm', 32, 64, $2)",
                               node_url, datetime.now(tz=UTC))
        finally:
            await conn.close()

    asyncio.run(register())
    from sqlalchemy.engine import make_url

    reader = make_url(DatabaseSettings().reader()).set(database=name).render_as_string(hide_password=False)
    port = free_port()
    proc = ServiceProcess(["router", "--port", str(port), "--log-level", "warning"],
                          {"KVFLOW_DATABASE_READER_URL": reader, "KVFLOW_ROUTER_SUSPECT_S": "0"},
                          tmp_path_factory.mktemp("fuzz") / "router.log").start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{base}/healthz"), 60, what="the router")
        yield base
    finally:
        proc.stop()
        asyncio.run(drop_database(owner, name))


def fuzz(base_url: str) -> dict[str, int]:
    """Every operation of the service's OpenAPI, with generated requests: none may answer 5xx."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    seen: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        check(base_url, op.as_strategy(), op.label, seen)
    return seen


def check(base_url: str, strategy: Any, label: str, seen: dict[str, int]) -> None:
    @given(case=strategy)
    @FUZZ
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, timeout=30)
        assert response.status_code < 500, (label, response.status_code, response.text[:300])
        seen[label] = seen.get(label, 0) + 1

    run()


def test_the_node_never_answers_5xx(node_url):
    seen = fuzz(node_url)
    assert {"POST /v1/completions", "GET /v1/kv/state", "GET /v1/kv/stats"} <= set(seen)
    assert seen["POST /v1/completions"] >= 10


def test_the_router_never_answers_5xx(router_url):
    seen = fuzz(router_url)
    assert {"POST /v1/route", "POST /v1/completions", "GET /v1/nodes"} <= set(seen)
    assert seen["POST /v1/route"] >= 10
