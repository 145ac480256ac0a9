"""The router with real nodes, Kafka, the materializer and PostgreSQL."""

from __future__ import annotations

import concurrent.futures
from collections import Counter

import httpx
import pytest

from tests.support import applied_through_id, wait_for

pytestmark = pytest.mark.integration

SYSTEM = "You are kvflow's test assistant. " * 12  # ~400 bytes: 12 blocks of 32 tokens


def test_a_prompt_cached_on_node_a_is_routed_to_a(fleet):
    router, db = fleet["router"], fleet["db"]
    r = httpx.post(f"{fleet['a']}/v1/completions", timeout=30, json={
        "prompt": SYSTEM + "first question?", "max_tokens": 2,
        "kv_retention": {"token_ranges": [{"start": 0, "end": None, "priority": 100}]}})
    assert r.status_code == 200
    wait_for(lambda: applied_through_id(db, "node-a", min_blocks=12), 30, what="node-a's blocks in PostgreSQL")

    decision = router.post("/v1/route", json={"prompt": SYSTEM + "another question"}).json()
    assert decision["node_id"] == "node-a" and decision["url"] == fleet["a"]
    assert decision["matched_blocks"] >= 12 and decision["matched_tokens"] == 32 * decision["matched_blocks"]
    cands = {c["node_id"]: c for c in decision["candidates"]}
    assert cands["node-b"]["matched_blocks"] == 0 and cands["node-a"]["cost"] < cands["node-b"]["cost"]

    done = router.post("/v1/completions", json={"prompt": SYSTEM + "another question", "max_tokens": 3})
    assert done.status_code == 200 and done.headers["x-kvflow-node"] == "node-a"
    assert done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 12 * 32

    with router.stream("POST", "/v1/completions", json={"prompt": SYSTEM + "streamed", "max_tokens": 3,
                                                         "stream": True}) as s:
        assert s.headers["x-kvflow-node"] == "node-a"
        assert [ln for ln in s.iter_lines() if ln.startswith("data: ")][-1] == "data: [DONE]"

    nodes = router.get("/v1/nodes").json()["nodes"]
    assert {n["node_id"]: n["status"] for n in nodes} == {"node-a": "live", "node-b": "live"}
    one = router.get("/v1/nodes/node-a").json()
    assert any(c["priority"] == 100 for c in one["cache_by_priority"])
    assert router.get("/v1/stats").json()["decisions"] >= 3


def test_with_nothing_cached_requests_spread_by_load(fleet):
    router = fleet["router"]

    def one(i: int) -> str:
        r = router.post("/v1/completions", json={"prompt": f"unique prompt number {i} " * 8, "max_tokens": 24})
        assert r.status_code == 200, r.text
        return r.headers["x-kvflow-node"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        counts = Counter(pool.map(one, range(16)))
    assert set(counts) == {"node-a", "node-b"}
    assert min(counts.values()) >= 4, counts


def test_a_node_that_fails_is_reported_as_an_upstream_error_and_avoided(fleet):
    router, db = fleet["router"], fleet["db"]
    prompt = "a prompt that only node-b has seen. " * 10
    assert httpx.post(f"{fleet['b']}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                      timeout=30).status_code == 200
    wait_for(lambda: applied_through_id(db, "node-b", min_blocks=10), 30, what="node-b's blocks")
    fleet["procs"]["b"].kill9()  # it still looks live in PostgreSQL for a few seconds

    r = router.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 502 and r.headers["x-kvflow-node"] == "node-b"
    err = r.json()["error"]
    assert err["type"] == "upstream_error" and err["node_id"] == "node-b" and "node-b failed" in err["message"]

    again = router.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert again.status_code == 200 and again.headers["x-kvflow-node"] == "node-a"
    node_b = next(n for n in router.get("/v1/nodes").json()["nodes"] if n["node_id"] == "node-b")
    assert node_b["suspect"] is True
    assert router.get("/v1/stats").json()["upstream_errors"] == 1
