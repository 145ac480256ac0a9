"""The router with real nodes, Kafka, the materializer and PostgreSQL."""

from __future__ import annotations

import httpx
import pytest

from routing_api.hubs import Hubs
from tests.support import applied_through_id, fetch, heartbeats_idle, wait_for

pytestmark = pytest.mark.integration

SYSTEM = "You are kvflow's test assistant. " * 12  # ~400 bytes: 12 blocks of 32 tokens


def test_a_prompt_cached_on_node_a_is_routed_to_a(fleet):
    router, db = fleet["router"], fleet["db"]
    r = httpx.post(f"{fleet['a']}/v1/completions", timeout=30, json={
        "prompt": SYSTEM + "first question?", "max_tokens": 2,
        "kv_retention": {"token_ranges": [{"start": 0, "end": None, "priority": 100}]}})
    assert r.status_code == 200
    wait_for(lambda: applied_through_id(db, "node-a", min_blocks=12), 30, what="node-a's blocks in PostgreSQL")
    # the request ran on node-a outside the router: until a heartbeat says it is done, node-a's
    # load is that request's, and the load bound would send the next one to idle node-b
    wait_for(lambda: heartbeats_idle(db, "node-a", "node-b"), 15, what="both nodes idle in their heartbeats")

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


def idle(db: str) -> bool:
    """Both nodes' latest heartbeats, in PostgreSQL, count no running request."""
    rows = fetch(db, "SELECT active_requests, active_blocks FROM nodes WHERE node_id IN ('node-a', 'node-b')")
    return len(rows) == 2 and all(r["active_requests"] == 0 and r["active_blocks"] == 0 for r in rows)


def test_with_nothing_cached_requests_spread_by_load(fleet):
    """A request in flight on one node sends the next (nothing cached anywhere) to the other.

    Driven, not raced: the request in flight is one the router counts (``start_proxy``, as its proxy
    does), and each step waits until neither node's heartbeat counts a running request."""
    router, db = fleet["router"], fleet["db"]
    state = router.app.state.router
    seen = []
    busy = "node-b"
    for i in range(6):
        wait_for(lambda: idle(db), 30, what="both nodes idle in their heartbeats")
        done = state.start_proxy(busy, 8)  # a request of 8 blocks in flight on `busy`
        try:
            r = router.post("/v1/completions", json={"prompt": f"unique prompt number {i} " * 8, "max_tokens": 4})
        finally:
            done("ok", ran=False)
        assert r.status_code == 200, r.text
        seen.append(r.headers["x-kvflow-node"])
        assert seen[-1] != busy, (i, seen)
        busy = seen[-1]
    assert seen == ["node-a", "node-b"] * 3


def test_a_node_that_fails_is_reported_as_an_upstream_error_and_avoided(fleet):
    """A node killed while it still looks live: its refused connection sends the request on to
    the other node (nothing was sent), the failure is counted, and the node is avoided."""
    router, db = fleet["router"], fleet["db"]
    prompt = "a prompt that only node-b has seen. " * 10
    assert httpx.post(f"{fleet['b']}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                      timeout=30).status_code == 200
    wait_for(lambda: applied_through_id(db, "node-b", min_blocks=10), 30, what="node-b's blocks")
    assert router.post("/v1/route", json={"prompt": prompt}).json()["node_id"] == "node-b"
    fleet["procs"]["b"].kill9()  # it still looks live in PostgreSQL for a few seconds

    r = router.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-kvflow-node"] == "node-a", r.text
    stats = router.get("/v1/stats").json()
    assert (stats["upstream_errors"], stats["proxied"]) == (1, 2)  # node-b refused, node-a answered
    node_b = next(n for n in router.get("/v1/nodes").json()["nodes"] if n["node_id"] == "node-b")
    assert node_b["suspect"] is True and node_b["status"] == "live"

    again = router.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert again.status_code == 200 and again.headers["x-kvflow-node"] == "node-a"
    assert router.get("/v1/stats").json()["upstream_errors"] == 1  # avoided: not tried again


def test_a_hub_held_by_a_node_over_the_bound_is_copied_to_the_idle_node(fleet):
    """The gate keeps a request on node-a, over the load bound but the only holder of the prompt's
    hub (a system prompt that several prompts continue): the router copies the hub to node-b with
    a completion of its token ids, and node-b then holds the same blocks (hashes as the router's)."""
    router, db = fleet["router"], fleet["db"]
    state = router.app.state.router
    state.hubs = Hubs(2)  # a hub after two distinct continuations (the default is 16)
    salt = {"cache_salt": "tenant-x"}
    assert httpx.post(f"{fleet['a']}/v1/completions", timeout=30, json={
        "prompt": SYSTEM + "first question, and a long one. " * 3, "max_tokens": 1, **salt}).status_code == 200
    wait_for(lambda: applied_through_id(db, "node-a", min_blocks=12), 30, what="node-a's blocks in PostgreSQL")
    for q in ("second", "third"):  # the routes teach the router the hub: block 12 is followed by 3 blocks
        assert router.post("/v1/route", json={"prompt": SYSTEM + f"{q} question, and a long one. " * 3,
                                              **salt}).json()["node_id"] == "node-a"
    wait_for(lambda: idle(db), 30, what="both nodes idle in their heartbeats")
    # node-a over the load bound: 25 requests of 8 blocks in hand, node-b none (many requests, so beyond
    # the bound's noise allowance too: with the prompt's ~14 blocks the mean is ~107, and
    # max(1.75 × 107, 107 + 2 √(107 × 8)) ≈ 187 < 200; as one request of 200 blocks it would be within it)
    dones = [state.start_proxy("node-a", 8) for _ in range(25)]
    try:
        r = router.post("/v1/completions", json={"prompt": SYSTEM + "fourth question, and a long one. " * 3,
                                                 "max_tokens": 2, **salt})
        assert r.status_code == 200 and r.headers["x-kvflow-node"] == "node-a", r.text
        assert state.recent[0]["reason"].startswith("bound gate: over the bound")
    finally:
        for done in dones:
            done("ok", ran=False)
    wait_for(lambda: state.metrics.warmups.labels("node-b", "ok")._value.get() == 1, 30, what="the copy answered")
    wait_for(lambda: applied_through_id(db, "node-b", min_blocks=12), 30, what="node-b's blocks in PostgreSQL")
    cands = {c["node_id"]: c for c in router.post("/v1/route", json={
        "prompt": SYSTEM + "fifth question, and a long one. " * 3, **salt}).json()["candidates"]}
    assert cands["node-b"]["matched_blocks"] == 12 and cands["node-a"]["matched_blocks"] == 12
