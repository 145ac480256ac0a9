"""Answers at the edges, in-process: the error shape for unknown paths, wrong methods and bodies
that are not JSON; an empty cache salt; and a router without PostgreSQL — never having seen it
(503, no fleet known yet), or losing it (degraded routing on the last known fleet, 503 on reads)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import to_sql
from routing_api.app import create_app
from routing_api.config import RouterSettings
from state_store.config import plain_dsn
from tests.support import TcpProxy, free_port, wait_for

NOWHERE = f"postgresql://kvflow_reader:kvflow_reader@127.0.0.1:{free_port()}/kvflow"  # nothing listens


@pytest.fixture
def nowhere():
    with TestClient(create_app(RouterSettings(nodes_cache_s=0.0), database_url=NOWHERE)) as c:
        yield c


def test_unknown_paths_and_wrong_methods_answer_in_the_error_shape(nowhere):
    r = nowhere.get("/v1/nope")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no such endpoint: GET /v1/nope", "type": "not_found"}}
    r = nowhere.get("/v1/route")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"error": {"message": "method not allowed: GET /v1/route (allowed: POST)",
                                  "type": "http_error"}}
    r = nowhere.delete("/v1/nodes")
    assert r.status_code == 405 and r.json()["error"]["message"] == (
        "method not allowed: DELETE /v1/nodes (allowed: GET)")


@pytest.mark.parametrize("path", ["/v1/route", "/v1/completions"])
def test_a_body_that_is_not_json_says_what_was_expected_and_where(nowhere, path):
    r = nowhere.post(path, content=b"hello", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json() == {"error": {"message": "the body must be a JSON object: Expecting value at line 1 column 1",
                                  "type": "invalid_request_error"}}
    r = nowhere.post(path, content=b'{"prompt":\n  oops}', headers={"content-type": "application/json"})
    assert r.json()["error"]["message"] == "the body must be a JSON object: Expecting value at line 2 column 3"


@pytest.mark.parametrize("path", ["/v1/route", "/v1/completions"])
def test_an_empty_cache_salt_is_refused_naming_the_field(nowhere, path):
    r = nowhere.post(path, json={"prompt": "x", "cache_salt": ""})
    assert r.status_code == 422
    assert r.json()["error"]["message"] == "cache_salt: String should have at least 1 character"


def test_a_router_that_never_saw_the_database_answers_503_no_fleet_known_yet(nowhere):
    for path, body in (("/v1/route", {"prompt": "hello"}), ("/v1/route", {"token_ids": [1, 2, 3]}),
                       ("/v1/completions", {"prompt": "hello"})):
        r = nowhere.post(path, json=body)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "unavailable" and err["message"].startswith("no fleet known yet: database unavailable")
    for path in ("/v1/nodes", "/v1/nodes/node-a", "/v1/dashboard/data"):
        r = nowhere.get(path)
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable", (path, r.text)
        assert r.json()["error"]["message"].startswith("database unavailable: ")
    health = nowhere.get("/healthz")
    assert health.status_code == 503
    assert health.json()["status"] == "database unreachable" and health.json()["error"]["type"] == "unavailable"
    assert (health.json()["degraded"], health.json()["known_nodes"]) == (False, 0)
    assert nowhere.get("/v1/stats").status_code == 200  # this process's memory only


TOKENS = list(range(2000, 2128))  # 4 blocks of 32


def fill(url: str) -> None:
    async def run() -> None:
        now = datetime.now(tz=UTC)
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            for node, status, bs, load in (("node-a", "live", 32, 3), ("node-b", "live", 32, 1),
                                           ("gone-1", "gone", 16, 0), ("gone-2", "gone", 32, 0)):
                await conn.execute(
                    "INSERT INTO nodes (node_id, instance_id, status, url, model, block_size, capacity_gpu,"
                    " active_blocks, last_seen) VALUES ($1, 'i', $2, $3, 'm', $4, 1000, $5, $6)",
                    node, status, f"http://{node}:1", bs, load, now)
            await conn.copy_records_to_table(  # node-a holds the whole prompt
                "node_blocks", columns=["node_id", "block_hash", "cache_level", "priority", "num_tokens",
                                        "stored_at", "updated_at"],
                records=[("node-a", to_sql(h), 0, 35, 32, now, now) for h in prompt_block_hashes(TOKENS, 32)])
        finally:
            await conn.close()

    asyncio.run(run())


def degraded_count(c: TestClient) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("kvflow_router_degraded_decisions_total "):
            return float(line.split()[1])
    raise AssertionError("no kvflow_router_degraded_decisions_total")


@pytest.mark.integration
def test_gone_nodes_are_counted_not_listed(migrated_database_url, reader_url):
    fill(migrated_database_url)
    with TestClient(create_app(RouterSettings(nodes_cache_s=0.0), database_url=reader_url)) as c:
        d = c.post("/v1/route", json={"token_ids": TOKENS}).json()
        assert [x["node_id"] for x in d["candidates"]] == ["node-a", "node-b"] and d["gone_nodes"] == 2
        assert d["node_id"] == "node-a" and d["degraded"] is False
        shown = [n["node_id"] for n in c.get("/v1/dashboard/data").json()["nodes"]]
        assert shown == ["node-a", "node-b", "gone-1", "gone-2"]  # live first
        assert [n["node_id"] for n in c.get("/v1/nodes").json()["nodes"]] == ["gone-1", "gone-2", "node-a", "node-b"]


@pytest.mark.integration
def test_losing_the_database_degrades_routing_and_it_comes_back_by_itself(migrated_database_url, reader_url):
    """PostgreSQL unreachable (a TCP proxy in front of it cut): decisions go on, by load alone over
    the last fleet read; reads answer 503; once it is reachable again, all is as before."""
    fill(migrated_database_url)
    target = make_url(reader_url)
    proxy = TcpProxy(target.port or 5432)
    url = target.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        with TestClient(create_app(RouterSettings(nodes_cache_s=0.0), database_url=url)) as c:
            before = c.post("/v1/route", json={"token_ids": TOKENS}).json()
            assert (before["node_id"], before["matched_blocks"], before["degraded"]) == ("node-a", 4, False)
            assert degraded_count(c) == 0

            proxy.cut()
            for _ in range(3):
                r = c.post("/v1/route", json={"token_ids": TOKENS})
                assert r.status_code == 200, r.text
                d = r.json()
                assert d["degraded"] is True and d["node_id"] == "node-b" and d["matched_blocks"] == 0  # by load
                assert d["reason"].startswith("degraded (PostgreSQL unreachable): the last known fleet, by load")
                assert d["gone_nodes"] == 2 and [x["node_id"] for x in d["candidates"]] == ["node-a", "node-b"]
            assert degraded_count(c) == 3
            for path in ("/v1/nodes", "/v1/nodes/node-a", "/v1/dashboard/data", "/healthz"):
                r = c.get(path)
                assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable", (path, r.text)
            assert c.get("/healthz").json()["degraded"] is True
            assert c.get("/v1/stats").status_code == 200

            proxy.restore()
            wait_for(lambda: not c.post("/v1/route", json={"token_ids": TOKENS}).json()["degraded"], 10,
                     what="routing with PostgreSQL again")
            after = c.post("/v1/route", json={"token_ids": TOKENS}).json()
            assert (after["node_id"], after["matched_blocks"]) == ("node-a", 4)
            assert c.get("/v1/nodes").status_code == 200 and c.get("/healthz").status_code == 200
            assert c.get("/v1/dashboard/data").status_code == 200
    finally:
        proxy.close()
