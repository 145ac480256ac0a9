"""The router's own state and access checks, without a server: keys and scopes, the fleet's
views per read, in-flight accounting and suspicion, decision counts."""

from __future__ import annotations

from decimal import Decimal

import pytest
from fastapi import HTTPException

from routing_api.config import RouterSettings, parse_api_keys
from routing_api.deps import authorize
from routing_api.fleet import FleetView, fleet_block_size, fleet_view
from routing_api.scoring import Candidate, Decision, Finished, NodeView, PrefixMatch, RoutingWeights
from routing_api.state import FINISHED_KEEP_S, FleetCache, Metrics, RouterState

KEYS = parse_api_keys("full:acme,reader::read")


def row(node_id: str, model: str | None = "llama", block_size: int | None = 32, status: str = "live",
        url: str | None = "http://n") -> dict:
    return {"node_id": node_id, "model": model, "block_size": block_size, "status": status, "url": url,
            "capacity_gpu": 100, "active_blocks": 1, "active_requests": 2, "queued_requests": 3}


def test_authorize_answers_401_or_403_exactly_as_the_endpoints_do():
    assert authorize({}, "", "read") is None  # no keys: open
    assert authorize(KEYS, "Bearer full", "complete") == KEYS["full"]
    assert authorize(KEYS, "bearer reader", "read") == KEYS["reader"]
    for header, message in (("", "missing bearer API key"), ("Basic full", "missing bearer API key"),
                            ("Bearer ", "missing bearer API key"), ("Bearer nope", "unknown API key")):
        with pytest.raises(HTTPException) as err:
            authorize(KEYS, header, "read")
        assert (err.value.status_code, err.value.detail, err.value.headers) == (
            401, message, {"WWW-Authenticate": "Bearer"})
    with pytest.raises(HTTPException) as err:
        authorize(KEYS, "Bearer reader", "route")
    assert (err.value.status_code, err.value.detail, err.value.headers) == (
        403, "this API key lacks the 'route' scope", None)


def test_the_fleet_view_excludes_other_models_and_unknown_addresses_and_views_each_node_in_its_block_size():
    rows = [row("a"), row("b", model="qwen"), row("c", block_size=16), row("d", url=None), row("e", model=None)]
    fv = fleet_view(rows, "llama")
    assert fv.block_size == 32
    assert fv.views[0] == NodeView("a", "http://n", "live", 100, 1, 2, 3, excluded="", block_size=32)
    assert [(v.node_id, v.status, v.excluded, v.block_size) for v in fv.views[1:]] == [
        ("b", "live", "serves qwen, not llama", 32), ("c", "live", "", 16),
        ("d", "unreachable", "", 32), ("e", "live", "serves an unknown model, not llama", 32)]
    assert fv.views[3].url == ""
    # the live candidates, by (model, block size): hashed once per size
    assert fv.groups == {("llama", 32): ("a",), ("llama", 16): ("c",)} and fv.sizes == (16, 32)


def test_a_block_size_override_excludes_the_other_sizes_as_before():
    rows = [row("a"), row("b", model="qwen"), row("c", block_size=16), row("d", block_size=None)]
    fv = fleet_view(rows, None, block_size=16)
    assert [(v.node_id, v.excluded) for v in fv.views] == [
        ("a", "block size 32; this fleet's prompts are hashed in blocks of 16"),
        ("b", "block size 32; this fleet's prompts are hashed in blocks of 16"), ("c", ""), ("d", "")]
    assert fv.block_size == 16 and fv.sizes == (16,) and fv.groups == {("llama", 16): ("c", "d")}
    assert fleet_view(rows, "llama", block_size=32).groups == {("llama", 32): ("a", "d")}  # no size: the decision's


def test_without_a_model_nodes_of_one_size_share_its_hashes_whatever_they_serve():
    rows = [row("a"), row("b", model="qwen"), row("c", model="qwen", block_size=16), row("s", status="stale"),
            row("r", status="resyncing", block_size=64)]
    fv = fleet_view(rows, None)
    assert fv.groups == {("llama", 32): ("a",), ("qwen", 32): ("b",), ("qwen", 16): ("c",)}
    assert fv.sizes == (16, 32)  # neither the stale node's nor the resyncing one's (no credit): no 64
    assert [v.block_size for v in fv.views] == [32, 32, 16, 32, 64]


def test_each_node_is_credited_only_with_the_matches_at_its_own_block_size():
    fv = fleet_view([row("a"), row("b"), row("c", block_size=16)], None)
    found = {32: {"a": PrefixMatch(gpu=2), "c": PrefixMatch(gpu=9)}, 16: {"c": PrefixMatch(gpu=4),
                                                                           "b": PrefixMatch(gpu=9)}}
    assert fv.own_size_matches(found) == {"a": PrefixMatch(gpu=2), "c": PrefixMatch(gpu=4)}
    one = fleet_view([row("a"), row("b")], None)
    at32 = {"a": PrefixMatch(gpu=2)}
    assert one.own_size_matches({32: at32}) is at32  # one size: the query's answer as it is
    assert one.own_size_matches({}) == {}


def test_the_block_size_is_the_live_majoritys_then_anyones_then_32():
    assert fleet_block_size([row("a", block_size=16), row("b", block_size=64), row("c", block_size=64)]) == 64
    assert fleet_block_size([row("a", block_size=64), row("b", block_size=16)]) == 16  # a tie: the smaller
    assert fleet_block_size([row("a", block_size=64, status="stale"), row("b", block_size=None)]) == 64
    assert fleet_block_size([row("a", block_size=None)]) == fleet_block_size([]) == 32


def test_the_fleet_cache_derives_views_once_per_read_and_model():
    cache = FleetCache(None)
    rows = [row("a"), row("b", model="qwen")]
    first = cache.view(rows, "llama")
    assert cache.view(rows, "llama") is first and cache.view(rows, None) is not first
    again = cache.view(list(rows), "llama")  # a new read of the table, equal rows
    assert again is not first and again == first
    assert FleetCache(16).view(rows, None).block_size == 16


def state(suspect_s: float = 10.0) -> RouterState:
    return RouterState(RouterSettings(suspect_s=suspect_s), reader=None, tokenizer=None, weights=RoutingWeights(),
                       keys={}, client=None, metrics=Metrics())


def sample(s: RouterState, name: str, **labels: str) -> float | None:
    return s.metrics.registry.get_sample_value(name, labels)


def test_a_proxied_request_is_in_flight_until_done_and_a_failure_makes_the_node_suspect():
    s = state()
    done_ok = s.start_proxy("a", 5)
    done_err = s.start_proxy("a", 3)
    assert (s.inflight["a"].requests, s.inflight["a"].blocks, s.proxied) == (2, 8, 2)
    assert s.router_inflight("a") == 2 and s.router_inflight("b") == 0 and "b" not in s.inflight
    assert sample(s, "kvflow_router_inflight_requests", node="a") == 2
    done_ok("ok")
    assert (s.inflight["a"].requests, s.inflight["a"].blocks, s.upstream_errors) == (1, 3, 0)
    assert not s.is_suspect("a")
    done_err("upstream_error")
    assert (s.inflight["a"].requests, s.inflight["a"].blocks, s.upstream_errors) == (0, 0, 1)
    assert s.is_suspect("a") and not s.is_suspect("b")
    assert sample(s, "kvflow_router_proxied_total", node="a", outcome="ok") == 1
    assert sample(s, "kvflow_router_proxied_total", node="a", outcome="upstream_error") == 1
    assert sample(s, "kvflow_router_inflight_requests", node="a") == 0
    s.start_proxy("b", 1)("client_error")
    assert not s.is_suspect("b") and sample(s, "kvflow_router_proxied_total", node="b", outcome="client_error") == 1
    s0 = state(suspect_s=0)
    s0.start_proxy("a", 1)("upstream_error")
    assert not s0.is_suspect("a") and s0.upstream_errors == 1  # KVFLOW_ROUTER_SUSPECT_S=0: never avoided


def test_a_decision_is_counted_and_kept_among_the_recent_ones():
    s = state()
    chosen = Candidate("a", "http://a", "live", True, gpu_blocks=2, host_blocks=1)
    s.record_decision(Decision(chosen, [chosen], 4, "why"), 4, 130, 96, 0.002)
    s.record_decision(Decision(None, [], 4, "no live node"), 4, 130, 0, 0.001)
    assert s.decisions == 2
    assert [{k: v for k, v in d.items() if k != "ts"} for d in s.recent] == [
        {"node_id": None, "prompt_tokens": 130, "matched_tokens": 0, "reason": "no live node"},
        {"node_id": "a", "prompt_tokens": 130, "matched_tokens": 96, "reason": "why"}]
    assert sample(s, "kvflow_router_decisions_total", node="a") == 1
    assert sample(s, "kvflow_router_matched_blocks_total") == 3
    assert sample(s, "kvflow_router_prompt_blocks_total") == 8
    assert sample(s, "kvflow_router_decision_seconds_count") == 2


def test_gone_nodes_are_no_candidates_only_a_count_and_the_heartbeats_time_is_kept():
    rows = [row("a"), {**row("b", block_size=16, status="gone")}, row("c", status="stale"),
            {**row("d"), "stats_ts": Decimal("1700000000.5")}, row("e", status="gone")]
    fv = fleet_view(rows, "llama")
    assert [v.node_id for v in fv.views] == ["a", "c", "d"] and fv.gone == 2
    assert fv.views[2].stats_ts == 1700000000.5 and fv.views[0].stats_ts == 0.0
    assert fleet_view([row("a", status="gone")], None) == FleetView(32, (), 1)


def test_finished_requests_are_remembered_for_a_while_unless_switched_off(monkeypatch):
    s = state()
    clock = [1000.0]
    monkeypatch.setattr("routing_api.state.time.time", lambda: clock[0])
    done = s.start_proxy("a", 7)
    clock[0] = 1000.8
    done("ok")
    assert list(s.finished["a"]) == [Finished(1000.0, 1000.8, 7)]
    s.start_proxy("a", 1)("upstream_error", ran=False)  # a refused connection never ran
    assert len(s.finished["a"]) == 1
    clock[0] = 1000.8 + FINISHED_KEEP_S + 0.1
    s.start_proxy("a", 2)("client_error")
    assert [f.blocks for f in s.finished["a"]] == [2]  # the old one is forgotten
    off = RouterState(RouterSettings(account_finished=False), reader=None, tokenizer=None,
                      weights=RoutingWeights(), keys={}, client=None, metrics=Metrics())
    off.start_proxy("a", 7)("ok")
    assert off.finished == {}


def test_the_dashboard_lists_live_nodes_first_and_gone_ones_last():
    from routing_api.routes.nodes import dashboard_order

    nodes = [{"node_id": n, "status": st, "suspect": sus} for n, st, sus in (
        ("a", "gone", False), ("b", "stale", False), ("c", "live", True), ("d", "live", False),
        ("e", "resyncing", False), ("f", "gone", False), ("g", "live", False), ("h", "unreachable", False))]
    assert [n["node_id"] for n in sorted(nodes, key=dashboard_order)] == ["d", "g", "c", "e", "b", "h", "a", "f"]
