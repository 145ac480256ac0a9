"""Prompt caching through the router, with real node processes, Kafka, the materializer and
PostgreSQL: breakpoints sent by the official ``openai`` SDK reach the node and its retained blocks
show their priority in ``node_blocks``; ``prompt_cache_key`` keeps a key's requests on one node,
known from PostgreSQL to another router, scoped to its tenant, with its hit rate in SQL; the seed's
fleet rule for requests that carry no retention; two tenants, one trying to pin everything at 100."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from openai_api.prompt_cache import BREAKPOINT_PRIORITY
from routing_api.app import create_app
from routing_api.config import RouterSettings
from tests.support import fetch, wait_for

pytestmark = pytest.mark.integration

MODEL = "kvflow-tiny-llama"
SYSTEM = "You are kvflow's test assistant; answer from the handbook. " * 8  # 472 bytes: 15 blocks of 32


def router_with(reader_url: str, **settings) -> TestClient:
    return TestClient(create_app(RouterSettings(nodes_cache_s=0.0, **settings), database_url=reader_url))


def sdk_of(router: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=router, max_retries=0)


def kv_priorities(url: str) -> list[int]:
    return [b["priority"] for b in httpx.get(f"{url}/v1/kv/state", timeout=10).json()["blocks"]]


def test_breakpoints_sent_by_the_sdk_through_the_router_retain_blocks_seen_in_postgresql(fleet):
    sdk, db = sdk_of(fleet["router"]), fleet["db"]
    out = sdk.chat.completions.create(
        model=MODEL, max_completion_tokens=2, prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        messages=[{"role": "system", "content": [{"type": "text", "text": SYSTEM,
                                                  "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]},
                  {"role": "user", "content": "Where is rule one?"}])
    info = out.model_extra["kvflow"]["prompt_cache"]
    end = len(f"<|system|>\n{SYSTEM}\n".encode()) // 32 * 32
    assert info["retained"] == [{"start": 0, "end": end, "priority": BREAKPOINT_PRIORITY, "duration_s": 43200.0}]
    node = out.model_extra["kvflow"]["node_id"]
    url = fleet["a"] if node == "node-a" else fleet["b"]
    assert kv_priorities(url).count(BREAKPOINT_PRIORITY) == end // 32

    def in_sql() -> bool:
        rows = fetch(db, "SELECT count(*) AS n FROM node_blocks WHERE node_id = $1 AND priority = $2",
                     node, BREAKPOINT_PRIORITY)
        return rows[0]["n"] == end // 32

    wait_for(in_sql, 30, what="the retained blocks in node_blocks")


def test_a_prompt_cache_key_keeps_its_requests_on_one_node_known_to_every_router(fleet, reader_url):
    router, db = fleet["router"], fleet["db"]
    sdk = sdk_of(router)
    nodes = []
    for i in range(4):  # prompts that share nothing: only the key can keep them together
        out = sdk.chat.completions.create(model=MODEL, max_completion_tokens=2, prompt_cache_key="doc-42",
                                          messages=[{"role": "user", "content": f"Question {i} " * (10 + i)}])
        nodes.append(out.model_extra["kvflow"]["node_id"])
    assert len(set(nodes)) == 1, nodes
    wait_for(lambda: fetch(db, "SELECT requests FROM prompt_cache_keys WHERE cache_key = 'doc-42'")
             and fetch(db, "SELECT requests FROM prompt_cache_keys WHERE cache_key = 'doc-42'")[0]["requests"] == 4,
             10, what="the key's row")
    (row,) = fetch(db, "SELECT tenant, model, node_id, prompt_tokens, cached_tokens FROM prompt_cache_keys")
    assert (row["tenant"], row["model"], row["node_id"]) == ("", MODEL, nodes[0]) and row["prompt_tokens"] > 0
    (rate,) = fetch(db, "SELECT hit_rate FROM prompt_cache_key_hit_rates WHERE cache_key = 'doc-42'")
    assert rate["hit_rate"] == row["cached_tokens"] / row["prompt_tokens"]
    # another router (a replica, or this one restarted) reads the key's node from PostgreSQL
    with router_with(reader_url) as other:
        decision = other.post("/v1/route", json={"prompt": "Something new entirely. " * 8, "model": MODEL,
                                                 "prompt_cache_key": "doc-42"}).json()
        assert decision["prompt_cache_key"]["node_id"] == nodes[0] and decision["node_id"] == nodes[0]
        keys = other.get("/v1/prompt_cache_keys").json()["keys"]
        assert [(k["cache_key"], k["requests"]) for k in keys] == [("doc-42", 4)]


def test_a_tenants_key_neither_steers_nor_shows_another_tenants_requests(fleet, reader_url):
    db = fleet["db"]
    with router_with(reader_url, api_keys="ka:acme,kb:globex") as router:
        acme, globex = sdk_of(router, "ka"), sdk_of(router, "kb")
        first = acme.chat.completions.create(model=MODEL, max_completion_tokens=1, prompt_cache_key="shared-name",
                                             messages=[{"role": "user", "content": "acme's question " * 8}])
        wait_for(lambda: fetch(db, "SELECT 1 FROM prompt_cache_keys WHERE tenant = 'acme'"), 10, what="acme's row")
        decision = router.post("/v1/route", headers={"authorization": "Bearer kb"},
                               json={"prompt": "globex question. " * 8, "model": MODEL,
                                     "prompt_cache_key": "shared-name"}).json()
        assert "prompt_cache_key" not in decision  # globex's key of the same name is another key
        globex.chat.completions.create(model=MODEL, max_completion_tokens=1, prompt_cache_key="shared-name",
                                       messages=[{"role": "user", "content": "globex's question " * 8}])
        wait_for(lambda: len(fetch(db, "SELECT 1 FROM prompt_cache_keys WHERE cache_key = 'shared-name'")) == 2, 10,
                 what="both tenants' rows")
        seen = router.get("/v1/prompt_cache_keys", headers={"authorization": "Bearer kb"}).json()["keys"]
        assert {k["tenant"] for k in seen} == {"globex"}
        assert first.model_extra["kvflow"]["node_id"]


def test_the_seed_rule_retains_the_system_prompt_of_requests_that_carry_nothing(fleet, reader_url):
    with router_with(reader_url, retention_rules="seed") as router:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Rule one?"}]
        out = router.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}).json()
        said = out["kvflow"]["router"]["retention"]
        assert (said["source"], said["rule"], said["lowered"]) == ("rule", "seed", [])
        end = len(f"<|system|>\n{SYSTEM}\n".encode()) // 32 * 32
        assert said["kv_retention"]["token_ranges"][0] == {"start": 0, "end": end, "priority": 100,
                                                           "duration_s": 3600.0}
        url = fleet["a"] if out["kvflow"]["node_id"] == "node-a" else fleet["b"]
        assert kv_priorities(url).count(100) == end // 32
        with router.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                  "max_tokens": 2, "stream": True}) as s:
            assert s.headers["x-kvflow-retention"] == "rule:seed"
        # a request with retention of its own keeps it: the rule does not apply
        own = router.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 1,
            "kv_retention": {"token_ranges": [{"start": 0, "end": 32, "priority": 70}]}})
        assert "router" not in own.json()["kvflow"] and "x-kvflow-retention" not in own.headers


def test_a_tenant_pinning_everything_at_100_is_lowered_and_the_other_is_not(fleet, reader_url, tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"tenants": {"greedy": {"max_priority": 60, "max_retained_share": 0.1}}}))
    with router_with(reader_url, api_keys="kg:greedy,kf:fair", retention_rules=str(policy)) as router:
        lowered = []
        for i in range(6):  # 6 prompts of 15 blocks pinned at 100; 10 % of 256 blocks is 25
            r = router.post("/v1/completions", headers={"authorization": "Bearer kg"}, json={
                "model": MODEL, "prompt": f"{i} " + SYSTEM, "max_tokens": 1,
                "kv_retention": {"token_ranges": [{"start": 0, "end": None, "priority": 100}]}})
            assert r.status_code == 200, r.text
            lowered.append(r.json()["kvflow"]["router"]["retention"]["lowered"])
        assert all("priority capped at 60" in low[0] for low in lowered)
        assert any("capped at 10% of its 256 blocks" in " ".join(low) for low in lowered)
        fair = router.post("/v1/completions", headers={"authorization": "Bearer kf"}, json={
            "model": MODEL, "prompt": "fair " + SYSTEM, "max_tokens": 1,
            "kv_retention": {"token_ranges": [{"start": 0, "end": None, "priority": 90}]}}).json()
        assert fair["kvflow"]["router"]["retention"]["lowered"] == []
        for url in (fleet["a"], fleet["b"]):
            prios = kv_priorities(url)
            assert max(prios) <= 90 and prios.count(60) <= 25
        assert sum(kv_priorities(u).count(60) for u in (fleet["a"], fleet["b"])) >= 25
