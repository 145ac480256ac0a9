"""A fleet of two block sizes, for real: two nodes (blocks of 16 and of 32), Kafka, the
materializer, PostgreSQL and the router. Each node caches the same prompt in its own blocks; the
router matches the prompt at each node's size and credits each with the tokens it holds."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from routing_api.app import create_app
from tests.inference_node.test_node_kafka import start_node
from tests.routing_api.weights import settings
from tests.support import applied_through_id, fetch, materializer, wait_for

pytestmark = pytest.mark.integration

# 400 bytes (the router and the nodes take a prompt's bytes as its tokens): 25 blocks of 16, but
# only 12 of 32 (384 tokens) are full.
SYSTEM = "You are kvflow's test assistant. " * 12 + "abcd"
KEEP = {"kv_retention": {"token_ranges": [{"start": 0, "end": None, "priority": 100}]}}


@pytest.fixture
def mixed(kafka_settings, migrated_database_url, reader_url, tmp_path):
    mat = materializer(kafka_settings, migrated_database_url, tmp_path).start()
    n16, url16 = start_node(kafka_settings, tmp_path, "node-16", num_blocks="256", block_size="16")
    n32, url32 = start_node(kafka_settings, tmp_path, "node-32", num_blocks="256", block_size="32")
    wait_for(lambda: all(applied_through_id(migrated_database_url, n) for n in ("node-16", "node-32")), 60,
             what="both nodes in PostgreSQL")
    router = TestClient(create_app(settings(nodes_cache_s=0.0), database_url=reader_url))
    with router:
        yield {"router": router, "16": url16, "32": url32, "db": migrated_database_url}
    for p in (n16, n32, mat):
        p.stop()


def idle(db: str) -> bool:
    rows = fetch(db, "SELECT active_requests, active_blocks FROM nodes WHERE node_id IN ('node-16', 'node-32')")
    return len(rows) == 2 and all(r["active_requests"] == 0 and r["active_blocks"] == 0 for r in rows)


def test_each_node_is_credited_with_the_prompt_it_holds_in_its_own_block_size(mixed):
    router, db = mixed["router"], mixed["db"]
    for size in ("16", "32"):
        r = httpx.post(f"{mixed[size]}/v1/completions", timeout=30,
                       json={"prompt": SYSTEM + "first question?", "max_tokens": 1, **KEEP})
        assert r.status_code == 200, r.text
    wait_for(lambda: applied_through_id(db, "node-16", min_blocks=25) and applied_through_id(db, "node-32",
                                                                                             min_blocks=12),
             30, what="both nodes' blocks in PostgreSQL")
    assert {r["node_id"]: r["block_size"] for r in fetch(db, "SELECT node_id, block_size FROM nodes")} == {
        "node-16": 16, "node-32": 32}
    wait_for(lambda: idle(db), 30, what="both nodes idle in their heartbeats")

    prompt = SYSTEM + "another question"  # 416 tokens: 26 blocks of 16, 13 of 32; 400 of them cached
    d = router.post("/v1/route", json={"prompt": prompt}).json()
    cands = {c["node_id"]: c for c in d["candidates"]}
    assert [(cands[n]["block_size"], cands[n]["prompt_blocks"], cands[n]["matched_blocks"],
             cands[n]["matched_tokens"]) for n in ("node-16", "node-32")] == [(16, 26, 25, 400), (32, 13, 12, 384)]
    # costs in blocks of 16 (a tie between one node of each size: the smaller), both idle
    assert d["cost_block_size"] == 16
    assert (cands["node-16"]["cached_credit"], cands["node-32"]["cached_credit"]) == (25.0, 24.0)
    assert (cands["node-16"]["cost"], cands["node-32"]["cost"]) == (1.0, 2.0)
    assert d["node_id"] == "node-16" and d["url"] == mixed["16"], d["reason"]
    assert (d["block_size"], d["prompt_blocks"], d["matched_blocks"], d["matched_tokens"]) == (16, 26, 25, 400)

    # proxied: the node's own blocks counted in flight and when finished; its cached tokens in the header
    state = router.app.state.router
    done = router.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert done.status_code == 200 and done.headers["x-kvflow-node"] == "node-16"
    assert done.headers["x-kvflow-matched-tokens"] == "400"
    assert done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 400
    assert state.finished["node-16"][-1].blocks == 26 and state.inflight["node-16"].blocks == 0

    # the 16-token node loaded (a request of 20 blocks of 16 in flight): node-32 is chosen, and the
    # answer's blocks are its own
    wait_for(lambda: idle(db), 30, what="both nodes idle in their heartbeats")
    busy = state.start_proxy("node-16", 20)
    try:
        d = router.post("/v1/route", json={"prompt": prompt}).json()
    finally:
        busy("ok", ran=False)
    cands = {c["node_id"]: c for c in d["candidates"]}
    assert cands["node-16"]["decode_blocks"] == 20.0 and d["node_id"] == "node-32", d["reason"]
    assert (d["block_size"], d["prompt_blocks"], d["matched_blocks"], d["matched_tokens"]) == (32, 13, 12, 384)
