"""The router's answers, formatted from decisions and rows: exactly these JSON shapes."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from decimal import Decimal

from routing_api.errors import error_body, error_json, error_response
from routing_api.schemas import candidate_json, decision_body, node_json
from routing_api.scoring import Candidate, Decision, NodeView, PrefixMatch, decide
from tests.routing_api.weights import weights


def test_a_decision_is_formatted_with_its_choice_and_every_candidate():
    views = [NodeView("a", "http://a", "live", 1000, active_blocks=2), NodeView("b", "http://b", "stale", 1000)]
    d = decide(3, views, {"a": PrefixMatch(gpu=1, host=1)}, weights(), block_size=32, tokens=100)
    body = decision_body(d, prompt_tokens=100, prompt_blocks=3, block_size=32, elapsed_s=0.0012345)
    reason = "cost 3.25 = 1.25 blocks to prefill + 2 blocks of load; 2/3 prompt blocks cached (1 on host)"
    assert body == {
        "node_id": "a", "url": "http://a", "matched_blocks": 2, "matched_tokens": 64, "cached_tokens": 64,
        "prompt_tokens": 100, "prompt_blocks": 3, "block_size": 32, "cost_block_size": 32, "reason": reason,
        "decision_ms": 1.234, "degraded": False, "gone_nodes": 0, "candidates": [
            {"node_id": "a", "status": "live", "eligible": True, "matched_blocks": 2, "gpu_blocks": 1,
             "host_blocks": 1, "block_size": 32, "prompt_blocks": 3, "matched_tokens": 64, "cached_credit": 1.75,
             "prefill_blocks": 1.25, "decode_blocks": 2.0, "cost": 3.25, "busy": False, "reason": reason},
            {"node_id": "b", "status": "stale", "eligible": False, "matched_blocks": 0, "gpu_blocks": 0,
             "host_blocks": 0, "block_size": 32, "prompt_blocks": 3, "matched_tokens": 0, "cached_credit": 0.0,
             "prefill_blocks": 0.0, "decode_blocks": 0.0, "cost": None, "busy": False,
             "reason": "stale: never chosen"}]}
    assert list(body) == ["node_id", "url", "matched_blocks", "matched_tokens", "cached_tokens", "prompt_tokens",
                          "prompt_blocks", "block_size", "cost_block_size", "reason", "decision_ms", "degraded",
                          "candidates", "gone_nodes"]  # the order clients see
    assert list(body["candidates"][0]) == [
        "node_id", "status", "eligible", "matched_blocks", "gpu_blocks", "host_blocks", "block_size", "prompt_blocks",
        "matched_tokens", "cached_credit", "prefill_blocks", "decode_blocks", "cost", "busy", "reason"]
    flagged = decision_body(d, prompt_tokens=100, prompt_blocks=3, block_size=32, elapsed_s=0.0, degraded=True,
                            gone_nodes=11)
    assert (flagged["degraded"], flagged["gone_nodes"]) == (True, 11)


def test_in_a_fleet_of_two_block_sizes_the_top_level_blocks_are_the_chosen_nodes():
    """``block_size``, ``prompt_blocks``, ``matched_*`` describe the choice, in its own block size;
    each candidate has its own; the costs are all in ``cost_block_size``."""
    views = [NodeView("v16", "http://v", "live", 1000, block_size=16), NodeView("k32", "http://k", "live", 1000,
                                                                                   block_size=32)]
    matches = {"v16": PrefixMatch(gpu=3), "k32": PrefixMatch(gpu=1)}
    d = decide(3, views, matches, weights(), block_size=32, tokens=100)  # 6 blocks of 16, 3 of 32
    body = decision_body(d, prompt_tokens=100, prompt_blocks=3, block_size=32, elapsed_s=0.0)
    assert {k: body[k] for k in ("node_id", "matched_blocks", "matched_tokens", "prompt_blocks", "block_size",
                                 "cost_block_size")} == {
        "node_id": "v16", "matched_blocks": 3, "matched_tokens": 48, "prompt_blocks": 6, "block_size": 16,
        "cost_block_size": 32}
    cands = {c["node_id"]: c for c in body["candidates"]}
    assert {k: cands["k32"][k] for k in ("block_size", "prompt_blocks", "matched_blocks", "matched_tokens",
                                         "cached_credit", "prefill_blocks", "cost")} == {
        "block_size": 32, "prompt_blocks": 3, "matched_blocks": 1, "matched_tokens": 32, "cached_credit": 1.0,
        "prefill_blocks": 2.0, "cost": 2.0}
    assert (cands["v16"]["cached_credit"], cands["v16"]["cost"]) == (1.5, 1.5)  # 48 tokens: 1.5 blocks of 32


def test_the_predicted_cached_tokens_are_all_but_the_last_when_every_token_is_matched():
    views = [NodeView("a", "http://a", "live", 1000)]
    d = decide(2, views, {"a": PrefixMatch(gpu=2, host=0)}, weights(), block_size=32, tokens=64)
    body = decision_body(d, prompt_tokens=64, prompt_blocks=2, block_size=32, elapsed_s=0.0)
    assert (body["matched_tokens"], body["cached_tokens"]) == (64, 63)  # the node computes the last one again
    body = decision_body(d, prompt_tokens=70, prompt_blocks=2, block_size=32, elapsed_s=0.0)
    assert (body["matched_tokens"], body["cached_tokens"]) == (64, 64)


def test_no_choice_is_formatted_with_nulls_and_zeros():
    d = Decision(None, [Candidate("b", "http://b", "gone", eligible=False, reason="gone: never chosen")], 4,
                 "no live node")
    body = decision_body(d, prompt_tokens=130, prompt_blocks=4, block_size=32, elapsed_s=0.5)
    assert {k: v for k, v in body.items() if k != "candidates"} == {
        "node_id": None, "url": None, "matched_blocks": 0, "matched_tokens": 0, "cached_tokens": 0,
        "prompt_tokens": 130,
        "prompt_blocks": 4, "block_size": 32, "cost_block_size": 32, "reason": "no live node", "decision_ms": 500.0,
        "degraded": False, "gone_nodes": 0}
    assert body["candidates"] == [candidate_json(d.candidates[0])]
    thirds = candidate_json(Candidate("x", "", "live", True, cached_credit=2 / 3, prefill_blocks=7 / 3,
                                      decode_blocks=1 / 7, cost=1 / 3))
    assert [thirds[k] for k in ("cached_credit", "prefill_blocks", "decode_blocks", "cost")] == [
        0.667, 2.333, 0.143, 0.333]
    assert candidate_json(Candidate("x", "", "live", False, cost=math.inf))["cost"] is None


def test_a_nodes_row_is_formatted_with_what_the_router_knows():
    row = {"node_id": "a", "status": "live", "last_seen": datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
           "counters": '{"prompt_tokens": 7}', "silent_s": Decimal("1.5"), "capacity_gpu": 10,
           "stats_ts": Decimal("1700000000.25")}
    assert node_json(row, router_inflight=2, suspect=True) == {
        "node_id": "a", "status": "live", "last_seen": "2024-01-02T03:04:05+00:00", "counters": {"prompt_tokens": 7},
        "silent_s": 1.5, "capacity_gpu": 10, "stats_ts": 1700000000.25, "router_inflight": 2, "suspect": True}
    bare = node_json({"node_id": "b", "last_seen": None, "counters": {"x": 1}, "silent_s": None}, 0, False)
    assert bare == {"node_id": "b", "last_seen": None, "counters": {"x": 1}, "silent_s": None,
                    "router_inflight": 0, "suspect": False}
    assert row["counters"] == '{"prompt_tokens": 7}'  # the row itself is left as it was


def test_errors_have_one_shape():
    assert error_body("bad", "invalid_request_error") == {"error": {"message": "bad", "type": "invalid_request_error"}}
    assert json.loads(error_json("gone", "not_found")) == {"error": {"message": "gone", "type": "not_found"}}
    r = error_response(502, "upstream node a failed", "upstream_error", node_id="a")
    assert (r.status_code, r.headers["x-kvflow-node"]) == (502, "a")
    assert json.loads(r.body) == {"error": {"message": "upstream node a failed", "type": "upstream_error",
                                            "node_id": "a"}}
    r = error_response(401, "missing bearer API key", "http_error", headers={"WWW-Authenticate": "Bearer"})
    assert r.headers["www-authenticate"] == "Bearer" and "x-kvflow-node" not in r.headers
