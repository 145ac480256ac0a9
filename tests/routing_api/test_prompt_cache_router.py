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
from sqlalchemy.engine import make_url

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import to_sql
from kvflow.bench.scratch import scratch_database
from openai_api.prompt_cache import BREAKPOINT_PRIORITY
from routing_api.app import create_app
from routing_api.config import RouterSettings
from state_store.config import DatabaseSettings
from tests.inference_node.test_node_kafka import start_node
from tests.support import applied_through_id, fetch, heartbeats_idle, materializer, own_topics, wait_for

pytestmark = pytest.mark.integration

MODEL = "kvflow-tiny-llama"
SYSTEM = "You are kvflow's test assistant; answer from the handbook. " * 8  # 472 bytes: 15 blocks of 32


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, pg_owner_url, tmp_path_factory):
    """Two node processes, a materializer and a router, shared by this module's tests (each test
    uses prompts of its own and checks the blocks of its own prompts)."""
    tmp = tmp_path_factory.mktemp("prompt-cache")
    with own_topics(kafka_bootstrap) as kafka, scratch_database(pg_owner_url, "kvflow_pc") as owner:
        reader_role = make_url(DatabaseSettings().reader())
        reader = make_url(owner).set(username=reader_role.username, password=reader_role.password)
        mat = materializer(kafka, owner, tmp).start()
        (a, url_a), (b, url_b) = (start_node(kafka, tmp, f"node-{x}", num_blocks="256") for x in "ab")
        try:
            wait_for(lambda: all(applied_through_id(owner, f"node-{x}") for x in "ab"), 60, what="both nodes")
            reader_url = reader.render_as_string(hide_password=False)
            with router_with(reader_url) as router:
                yield {"router": router, "a": url_a, "b": url_b, "db": owner, "reader_url": reader_url}
        finally:
            for proc in (a, b, mat):
                proc.stop()


@pytest.fixture
def reader_url(fleet):
    return fleet["reader_url"]


def router_with(reader_url: str, **settings) -> TestClient:
    return TestClient(create_app(RouterSettings(nodes_cache_s=0.0, **settings), database_url=reader_url))


def url_of(fleet, node: str) -> str:
    return fleet["a"] if node == "node-a" else fleet["b"]


def block_priorities(url: str, text: str, salt: str | None = None) -> list[int | None]:
    """The priority of each full block of ``text`` (the byte model's tokens) on the node; None: not cached."""
    cached = {b["block_hash"]: b["priority"] for b in httpx.get(f"{url}/v1/kv/state", timeout=10).json()["blocks"]}
    return [cached.get(h) for h in prompt_block_hashes(list(text.encode()), 32, cache_salt=salt)]


def sdk_of(router: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=router, max_retries=0)


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
    prompt = f"<|system|>\n{SYSTEM}\n<|user|>\nWhere is rule one?\n<|assistant|>\n"
    prios = block_priorities(url_of(fleet, node), prompt)
    assert prios[:end // 32] == [BREAKPOINT_PRIORITY] * (end // 32) and set(prios[end // 32:]) == {35}
    hashes = [to_sql(h) for h in prompt_block_hashes(list(prompt.encode()), 32)[:end // 32]]

    def in_sql() -> bool:
        rows = fetch(db, "SELECT count(*) AS n FROM node_blocks WHERE node_id = $1 AND priority = $2 "
                         "AND block_hash = ANY($3::bigint[])", node, BREAKPOINT_PRIORITY, hashes)
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
    (row,) = fetch(db, "SELECT tenant, model, node_id, prompt_tokens, cached_tokens FROM prompt_cache_keys "
                       "WHERE cache_key = 'doc-42'")
    assert (row["tenant"], row["model"], row["node_id"]) == ("", MODEL, nodes[0]) and row["prompt_tokens"] > 0
    (rate,) = fetch(db, "SELECT hit_rate FROM prompt_cache_key_hit_rates WHERE cache_key = 'doc-42'")
    assert rate["hit_rate"] == row["cached_tokens"] / row["prompt_tokens"]
    # another router (a replica, or this one restarted) reads the key's node from PostgreSQL; it
    # has not seen the key's requests finish, so it waits for heartbeats that say so (else the
    # load bound weighs their leftover load)
    wait_for(lambda: heartbeats_idle(db, "node-a", "node-b"), 15, what="both nodes idle in their heartbeats")
    with router_with(reader_url) as other:
        decision = other.post("/v1/route", json={"prompt": "Something new entirely. " * 8, "model": MODEL,
                                                 "prompt_cache_key": "doc-42"}).json()
        assert decision["prompt_cache_key"]["node_id"] == nodes[0] and decision["node_id"] == nodes[0]
        keys = other.get("/v1/prompt_cache_keys").json()["keys"]
        assert [(k["tenant"], k["requests"]) for k in keys if k["cache_key"] == "doc-42"] == [("", 4)]


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
        system = "Seed rule. " + SYSTEM
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Rule one?"}]
        out = router.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}).json()
        said = out["kvflow"]["router"]["retention"]
        assert (said["source"], said["rule"], said["lowered"]) == ("rule", "seed", [])
        end = len(f"<|system|>\n{system}\n".encode()) // 32 * 32
        assert said["kv_retention"]["token_ranges"][0] == {"start": 0, "end": end, "priority": 100,
                                                           "duration_s": 3600.0}
        prompt = f"<|system|>\n{system}\n<|user|>\nRule one?\n<|assistant|>\n"
        prios = block_priorities(url_of(fleet, out["kvflow"]["node_id"]), prompt)
        assert prios[:end // 32] == [100] * (end // 32) and set(prios[end // 32:]) == {0}  # the seed's one-off
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
        held: dict[str, list[int | None]] = {"node-a": [], "node-b": []}
        prompts = []
        for i in range(6):  # 6 prompts of 15 blocks pinned at 100; 10 % of 256 blocks is 25
            prompts.append(f"{i} " + SYSTEM)
            r = router.post("/v1/completions", headers={"authorization": "Bearer kg"}, json={
                "model": MODEL, "prompt": prompts[-1], "max_tokens": 1,
                "kv_retention": {"token_ranges": [{"start": 0, "end": None, "priority": 100}]}})
            assert r.status_code == 200, r.text
            lowered.append(r.json()["kvflow"]["router"]["retention"]["lowered"])
            node = r.headers["x-kvflow-node"]
            held[node] += block_priorities(url_of(fleet, node), prompts[-1], salt="greedy")
        assert all("priority capped at 60" in low[0] for low in lowered)
        assert any("capped at 10% of its 256 blocks" in " ".join(low) for low in lowered)
        fair = router.post("/v1/completions", headers={"authorization": "Bearer kf"}, json={
            "model": MODEL, "prompt": "fair " + SYSTEM, "max_tokens": 1,
            "kv_retention": {"token_ranges": [{"start": 0, "end": None, "priority": 90}]}}).json()
        assert fair["kvflow"]["router"]["retention"]["lowered"] == []
        fair_node = url_of(fleet, fair["kvflow"]["node_id"])
        assert set(block_priorities(fair_node, "fair " + SYSTEM, salt="fair")) == {90}
        for prios in held.values():  # greedy's blocks on each node: at most 60, and at most 25 of them retained
            assert set(prios) <= {60, 35} and prios.count(60) <= 25
        assert sum(p.count(60) for p in held.values()) >= 25  # one node at least got 45 blocks' worth
