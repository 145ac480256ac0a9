"""Which nodes may serve a request: model, block size, and a known address, from the nodes table;
a fleet of two block sizes, each node matched at its own.

The rows are written directly (as the materializer would), so each rule is checked in isolation.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import asyncpg
import pytest
from fastapi.testclient import TestClient

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import to_sql
from routing_api.app import create_app
from state_store.config import plain_dsn
from tests.routing_api.weights import settings

pytestmark = pytest.mark.integration

TOKENS = list(range(1000, 1128))  # 4 blocks of 32, 8 of 16

NODES = [  # node_id, model, block_size, url, blocks of the prompt cached
    ("llama-a", "llama", 32, "http://a:1", 1),
    ("llama-b", "llama", 32, "http://b:1", 3),
    ("qwen-a", "qwen", 32, "http://q:1", 4),
    ("llama-16", "llama", 16, "http://c:1", 8),
    ("llama-nourl", "llama", 32, "", 4),
]


def fill(url: str) -> None:
    async def run() -> None:
        now = datetime.now(tz=UTC)
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            for node, model, bs, node_url, cached in NODES:
                await conn.execute(
                    "INSERT INTO nodes (node_id, instance_id, status, url, model, block_size, capacity_gpu, last_seen)"
                    " VALUES ($1, 'i', 'live', $2, $3, $4, 1000, $5)", node, node_url, model, bs, now)
                hashes = [to_sql(h) for h in prompt_block_hashes(TOKENS, bs)][:cached]
                await conn.copy_records_to_table(
                    "node_blocks", columns=["node_id", "block_hash", "cache_level", "priority", "num_tokens",
                                            "stored_at", "updated_at"],
                    records=[(node, h, 0, 35, bs, now, now) for h in hashes])
        finally:
            await conn.close()

    asyncio.run(run())


def test_model_and_address_decide_who_may_serve_and_every_block_size_is_matched_at_its_own(
        migrated_database_url, reader_url):
    fill(migrated_database_url)
    # The cost alone (the load bound off): its ties go to the node id (with the bound, at random)
    with TestClient(create_app(settings(nodes_cache_s=0.0, load_bound=0.0), database_url=reader_url)) as c:
        llama = c.post("/v1/route", json={"token_ids": TOKENS, "model": "llama"}).json()
        why = {x["node_id"]: (x["eligible"], x["reason"]) for x in llama["candidates"]}
        assert why["qwen-a"] == (False, "serves qwen, not llama")
        assert why["llama-nourl"] == (False, "unreachable: never chosen")
        # llama-16 holds the whole prompt in blocks of 16 (128 tokens), llama-b 3 blocks of 32 (96)
        assert llama["node_id"] == "llama-16", llama["reason"]
        assert {k: llama[k] for k in ("matched_blocks", "matched_tokens", "prompt_blocks", "block_size",
                                      "cost_block_size")} == {
            "matched_blocks": 8, "matched_tokens": 128, "prompt_blocks": 8, "block_size": 16, "cost_block_size": 32}
        cands = {x["node_id"]: x for x in llama["candidates"]}
        assert [(cands[n]["block_size"], cands[n]["matched_blocks"], cands[n]["matched_tokens"],
                 cands[n]["prompt_blocks"], cands[n]["cached_credit"], cands[n]["cost"])
                for n in ("llama-16", "llama-b", "llama-a")] == [
            (16, 8, 128, 8, 4.0, 0.0), (32, 3, 96, 4, 3.0, 1.0), (32, 1, 32, 4, 1.0, 3.0)]
        assert llama["reason"] == ("cost 0.00 = 0.00 blocks to prefill + 0 blocks of load (blocks of 32 tokens); "
                                   "8/8 prompt blocks of 16 tokens cached (0 on host); next best llama-b at 1.00")

        assert c.post("/v1/route", json={"token_ids": TOKENS, "model": "qwen"}).json()["node_id"] == "qwen-a"
        # Without a model every node is a candidate: qwen-a (4 blocks of 32) and llama-16 (8 of 16)
        # hold the same 128 tokens, at the same cost; the node id breaks the tie.
        anyone = c.post("/v1/route", json={"token_ids": TOKENS}).json()
        costs = {x["node_id"]: x["cost"] for x in anyone["candidates"]}
        assert costs["qwen-a"] == costs["llama-16"] == 0.0 and anyone["node_id"] == "llama-16"

        missing = c.post("/v1/route", json={"token_ids": TOKENS, "model": "gpt-5"})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "model 'gpt-5' is not served by any node"
        assert c.post("/v1/completions", json={"prompt": TOKENS, "model": "gpt-5"}).status_code == 404


def test_a_block_size_override_makes_the_other_sizes_ineligible(migrated_database_url, reader_url):
    fill(migrated_database_url)
    with TestClient(create_app(settings(nodes_cache_s=0.0, block_size=16), database_url=reader_url)) as c:
        r = c.post("/v1/route", json={"token_ids": TOKENS, "model": "llama"}).json()
        assert r["node_id"] == "llama-16" and r["matched_blocks"] == 8 and r["prompt_blocks"] == 8
        why = {x["node_id"]: (x["eligible"], x["reason"]) for x in r["candidates"]}
        assert why["llama-b"] == (False, "block size 32; this fleet's prompts are hashed in blocks of 16")
    with TestClient(create_app(settings(nodes_cache_s=0.0, block_size=32), database_url=reader_url)) as c:
        r = c.post("/v1/route", json={"token_ids": TOKENS, "model": "llama"}).json()
        assert r["node_id"] == "llama-b" and r["matched_blocks"] == 3 and r["block_size"] == 32
        why = {x["node_id"]: (x["eligible"], x["reason"]) for x in r["candidates"]}
        assert why["llama-16"] == (False, "block size 16; this fleet's prompts are hashed in blocks of 32")
        assert r["reason"] == "cost 1.00 = 1.00 blocks to prefill + 0 blocks of load; 3/4 prompt blocks cached " \
                              "(0 on host); next best llama-a at 3.00"


def test_token_ids_outside_u32_are_refused_before_hashing(migrated_database_url, reader_url):
    fill(migrated_database_url)  # found by the fuzz test: a negative id used to reach the hasher (500)
    with TestClient(create_app(settings(nodes_cache_s=0.0), database_url=reader_url)) as c:
        for bad in ([-1], [1 << 32]):
            r = c.post("/v1/route", json={"token_ids": bad})
            assert r.status_code == 422 and r.json()["error"]["message"].startswith("token_ids.0:"), r.text
            r = c.post("/v1/completions", json={"prompt": bad})
            assert r.status_code == 422 and "prompt" in r.json()["error"]["message"], r.text


def test_the_load_of_a_request_seen_finishing_is_taken_off_the_heartbeat_that_counted_it(
        migrated_database_url, reader_url, monkeypatch):
    """node-a holds the prompt, but its latest heartbeat (taken 1 s ago) still counts a request of
    100 blocks that the router has since seen finish: that load is gone, and node-a gets the prompt."""
    heartbeat = time.time() - 1.0

    async def run() -> None:
        conn = await asyncpg.connect(plain_dsn(migrated_database_url))
        now = datetime.now(tz=UTC)
        try:
            for node, load in (("node-a", 100), ("node-b", 0)):
                await conn.execute(
                    "INSERT INTO nodes (node_id, instance_id, status, url, model, block_size, capacity_gpu,"
                    " active_blocks, active_requests, last_seen) VALUES ($1, 'i', 'live', $2, 'm', 32, 1000, $3, $4,"
                    " $5)", node, f"http://{node}:1", load, 1 if load else 0, now)
                await conn.execute(
                    "INSERT INTO node_stats_samples (node_id, instance_id, ts, capacity_gpu, capacity_host, used_gpu,"
                    " used_host, active_requests, queued_requests) VALUES ($1, 'i', $2, 1000, 0, $3, 0, 0, 0),"
                    " ($1, 'i', $4, 1000, 0, 0, 0, 0, 0)", node, datetime.fromtimestamp(heartbeat, tz=UTC), load,
                    datetime.fromtimestamp(heartbeat - 1, tz=UTC))
            await conn.copy_records_to_table(
                "node_blocks", columns=["node_id", "block_hash", "cache_level", "priority", "num_tokens", "stored_at",
                                        "updated_at"],
                records=[("node-a", to_sql(h), 0, 35, 32, now, now) for h in prompt_block_hashes(TOKENS, 32)])
        finally:
            await conn.close()

    asyncio.run(run())
    clock = [0.0]
    for account, expected in ((True, "node-a"), (False, "node-b")):
        app = create_app(settings(nodes_cache_s=0.0, account_finished=account), database_url=reader_url)
        with TestClient(app) as c:
            d = c.post("/v1/route", json={"token_ids": TOKENS}).json()
            assert d["node_id"] == "node-b", d["reason"]  # 4 blocks to prefill < 100 of load
            nodes = {n["node_id"]: n for n in c.get("/v1/nodes").json()["nodes"]}
            assert abs(nodes["node-a"]["stats_ts"] - heartbeat) < 0.01  # the latest heartbeat's own time
            # a request proxied to node-a from before that heartbeat until now (the proxy's bookkeeping)
            clock[0] = heartbeat - 0.5
            monkeypatch.setattr("routing_api.state.time.time", lambda: clock[0])
            done = app.state.router.start_proxy("node-a", 100)
            clock[0] = heartbeat + 1.0  # it ended after the heartbeat that counted it
            done("ok")
            monkeypatch.undo()
            d = c.post("/v1/route", json={"token_ids": TOKENS}).json()
            assert d["node_id"] == expected, d["reason"]
            a = next(x for x in d["candidates"] if x["node_id"] == "node-a")
            assert a["decode_blocks"] == (0.0 if account else 100.0)
