"""The node's HTTP API in-process: completions, streaming, ground truth, and clear 4xx errors."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from eventbus.replay import NodeState
from inference_node.server import create_app

from .conftest import make_node


@pytest.fixture
def client():
    node = make_node()
    with TestClient(create_app(node)) as c:
        c.node = node  # type: ignore[attr-defined]
        yield c
    node.close()


def test_completion_reports_cached_tokens_and_names_the_node(client):
    body = {"prompt": "kvflow " * 10, "max_tokens": 4,
            "kv_retention": {"token_ranges": [{"start": 0, "end": 32, "priority": 100}]}}
    first = client.post("/v1/completions", json=body).json()
    second = client.post("/v1/completions", json={"prompt": "kvflow " * 10, "max_tokens": 4}).json()
    assert first["usage"]["prompt_tokens"] == 70 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert first["object"] == "text_completion" and first["kvflow"]["node_id"] == "node-a"


def stream_chunks(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_streaming_sends_one_event_per_token_then_the_finish_then_done(client):
    chunks = stream_chunks(client, {"prompt": [1, 2, 3, 4], "max_tokens": 3})
    assert [len(c["choices"][0].get("token_ids", [])) for c in chunks] == [1, 1, 1, 0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # OpenAI's: only with stream_options.include_usage


def test_stream_options_include_usage_adds_a_last_event_with_the_usage(client):
    chunks = stream_chunks(client, {"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream_options": {"include_usage": True}})
    assert [c["usage"] for c in chunks[:-1]] == [None] * 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}


def test_kv_state_is_the_ground_truth_the_events_describe(client):
    for i in range(5):
        client.post("/v1/completions", json={"prompt": [i] * 40 + list(range(40)), "max_tokens": 2})
    state = client.get("/v1/kv/state").json()
    sink = client.node.sink  # type: ignore[attr-defined]
    client.node.engine.call(client.node.engine.publisher.pump).result(5)  # type: ignore[attr-defined]
    replayed = NodeState().apply_all(e for b in sink.batches for e in b.events)
    assert state["last_event_id"] == replayed.last_event_id
    assert {b["block_hash"]: (b["parent_hash"], b["cache_level"], b["priority"]) for b in state["blocks"]} == {
        h: (s.parent_hash, s.cache_level, s.priority) for h, s in replayed.blocks.items()}
    stats = client.get("/v1/kv/stats").json()
    assert stats["kv"]["requests"] == 5 and stats["blocks"]["gpu_capacity"] == 64
    assert client.get("/healthz").json()["status"] == "ok"
    assert "kvflow_node_requests_total" in client.get("/metrics").text


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"prompt": "x", "max_tokens": 2, "kv_retention": {"token_ranges": [
        {"start": 0, "end": 10, "priority": 50}, {"start": 5, "end": None, "priority": 9}]}}, 400, "overlap"),
    ({"prompt": "x", "kv_retention": {"token_ranges": [{"start": 0, "priority": 101}]}}, 422,
     "kv_retention.token_ranges.0.priority: Input should be less than or equal to 100"),
    ({"prompt": "x", "kv_retention": {"decode_priority": -1}}, 422,
     "kv_retention.decode_priority: Input should be greater than or equal to 0"),
    ({"prompt": "x", "kv_retention": {"token_ranges": [{"start": 0, "priority": 50, "duration_s": -1}]}}, 400,
     "duration_s must be finite and >= 0"),
    ({"prompt": "x", "max_tokens": "many"}, 422, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "suffix": "after"}, 400, "unsupported parameter: suffix: insertion after a suffix"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of 2 != n 1"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options needs stream: true"),
    ({"prompt": "x", "logit_bias": {"999999": 5}}, 400, "logit_bias: '999999' is not a token id"),
    ({"prompt": "x", "logit_bias": {"65": 5, "065": 1}}, 400, "logit_bias token id 65 appears more than once"),
    ({"prompt": "x", "top_p": 1.5}, 422, "top_p: Input should be less than or equal to 1"),
    ({"prompt": "x", "n": 17}, 422, "n: Input should be less than or equal to 16"),
    ({"prompt": ""}, 400, "the prompt is empty"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt token ids must be within"),
    ({"prompt": [1, -2]}, 422, "Input should be greater than or equal to 0"),
    ({"prompt": "x", "temperature": 1.0, "seed": 1 << 64}, 422, "seed: Input should be less than or equal to"),
    ({"prompt": "x" * 4100, "max_tokens": 8}, 400, "exceeds the context length of 4096"),
    ({"prompt": "x" * 1500, "max_tokens": 8}, 400, "needs 95 KV blocks; the node has 64"),
    ({"prompt": "x", "model": "gpt-5"}, 404, "is not served here"),
    ({"max_tokens": 2}, 422, "prompt: Field required"),
    ({"prompt": "x", "cache_salt": ""}, 422, "cache_salt: String should have at least 1 character"),
])
def test_invalid_requests_get_a_4xx_that_says_why_and_the_node_keeps_serving(client, body, status, fragment):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 1}).status_code == 200


def test_wrong_content_type_and_oversized_bodies_are_refused(client):
    r = client.post("/v1/completions", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert r.status_code == 422
    r = client.post("/v1/completions", content=b"{" + b" " * (5 * 1024 * 1024) + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 413

    def chunked():  # no Content-Length: the limit counts the bytes as they are read
        yield b"{"
        for _ in range(5 * 1024):
            yield b" " * 1024
        yield b"}"

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "request body larger than" in r.json()["error"]["message"]


def test_api_keys_when_configured():
    node = make_node(api_keys=SecretStr("k1,k2"))
    try:
        with TestClient(create_app(node)) as c:
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
            bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                         headers={"authorization": "Bearer nope"})
            assert bad.status_code == 401
            ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                        headers={"authorization": "Bearer k2"})
            assert ok.status_code == 200
            assert c.get("/healthz").status_code == 200  # health stays open for probes
    finally:
        node.close()


def test_a_crashed_engine_answers_503_at_once_and_never_hangs(client):
    engine = client.node.engine
    assert client.post("/v1/completions", json={"prompt": "before", "max_tokens": 1}).status_code == 200

    def boom() -> None:
        raise RuntimeError("boom: a device fault")

    engine._housekeeping = boom  # the next loop iteration dies (a stand-in for a CUDA error)
    with engine._wake:
        engine._wake.notify()
    engine._thread.join(10)
    assert not engine._thread.is_alive() and engine.fatal is not None

    assert client.get("/healthz").status_code == 503
    for _ in range(3):  # every later request gets its answer, not a hang
        r = client.post("/v1/completions", json={"prompt": "after", "max_tokens": 1})
        assert r.status_code == 503 and "engine crashed: boom" in r.json()["error"]["message"]
    for path in ("/v1/kv/state", "/v1/kv/stats"):
        r = client.get(path)
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"], path


def test_an_adaptive_node_takes_its_routed_settings_and_shows_what_it_learned(monkeypatch):
    monkeypatch.setenv("KVFLOW_NODE_ADAPTIVE_FREQUENCY_HORIZONS", "2")
    monkeypatch.setenv("KVFLOW_NODE_ADAPTIVE_SOON_SHARE", "0.3")
    monkeypatch.setenv("KVFLOW_NODE_ADAPTIVE_LIFE_TABLES", "false")
    monkeypatch.setenv("KVFLOW_NODE_ADAPTIVE_FLOOR", "false")
    node = make_node(adaptive=True)
    try:
        assert node.core.adaptive is not None
        assert node.core.adaptive.policy.frequency_horizons == 2.0
        assert node.core.adaptive.policy.soon_share == 0.3
        assert node.core.adaptive.policy.life_tables is False and node.core.adaptive.life is None
        stats = TestClient(create_app(node)).get("/v1/kv/stats").json()
        assert stats["adaptive"]["bands"] is True and stats["adaptive"]["switches"] == 0
        assert stats["adaptive"]["life"] is None and stats["adaptive"]["floor"] is None
    finally:
        node.close()
    monkeypatch.delenv("KVFLOW_NODE_ADAPTIVE_LIFE_TABLES")
    monkeypatch.delenv("KVFLOW_NODE_ADAPTIVE_FLOOR")
    node = make_node(adaptive=True)  # the default: life tables on, their state in the stats
    try:
        stats = TestClient(create_app(node)).get("/v1/kv/stats").json()
        life = stats["adaptive"]["life"]
        assert life["demotions"] == 0 and life["alive"] == {"recency": 0, "frequency": 0}
        assert set(life["p"]) == {str(node.core.adaptive.cache_blocks * m) for m in (1, 4)} | {
            str(node.core.adaptive.cache_blocks // 4)}
        floor = stats["adaptive"]["floor"]  # on by default, not engaged on a fresh cache
        assert floor["engaged"] is False and floor["switches"] == 0 and floor["deficit"] == 0
        assert stats["adaptive"]["strict"] == {"on": False, "switches": 0, "lead": 0.0, "hold": 0}
    finally:
        node.close()
    monkeypatch.setenv("KVFLOW_NODE_ADAPTIVE_STRICT_GUARD", "false")
    node = make_node(adaptive=True)  # the life tables without their guard
    try:
        assert node.core.adaptive is not None and node.core.adaptive.policy.strict_guard is False
        assert TestClient(create_app(node)).get("/v1/kv/stats").json()["adaptive"]["strict"] is None
    finally:
        node.close()
        monkeypatch.delenv("KVFLOW_NODE_ADAPTIVE_STRICT_GUARD")
