"""Bounded work: the prefill work the router routed to each node lately, decayed, bounded by (1 + ε) × the mean."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from types import SimpleNamespace

import pytest

from routing_api.config import RouterSettings
from routing_api.scoring import (
    DEFAULT_WEIGHTS,
    NodeView,
    PrefixMatch,
    RoutedWork,
    decide,
    overlay,
    routed_work,
)
from routing_api.state import Inflight
from tests.routing_api.test_scoring_bound import _random_fleet
from tests.routing_api.weights import weights

W = weights(load_bound=0.75, overlap_weight=24.0, work_bound=0.25, work_tau_s=60.0)


def node(nid: str, work: float = 0.0, requests: int = 0, blocks: int = 0) -> NodeView:
    return NodeView(nid, f"http://{nid}", "live", 10_000, inflight_requests=requests, inflight_blocks=blocks,
                    routed_work=work)


def test_the_work_bound_is_on_by_default_and_a_setting():
    assert DEFAULT_WEIGHTS.work_bound == 0.25 and DEFAULT_WEIGHTS.work_tau_s == 60.0
    w = RouterSettings(work_bound=0.0, work_tau_s=30).weights()
    assert (w.work_bound, w.work_tau_s) == (0.0, 30.0)


def test_routed_work_decays_with_its_time_constant():
    w = RoutedWork().plus(10, now=100.0, tau=60.0)
    assert w == RoutedWork(10.0, 100.0)
    assert w.at(160.0, 60.0) == pytest.approx(10 / math.e)
    assert w.at(90.0, 60.0) == 10.0  # never grows back
    assert w.plus(5, 160.0, 60.0).value == pytest.approx(10 / math.e + 5)


def test_overlay_lays_the_work_decayed_to_now_over_the_views():
    views = [NodeView("a", "", "live", 100), NodeView("b", "", "live", 100)]
    out = overlay(views, {}, {"b": Inflight(1, 4)}, now=60.0, work={"a": RoutedWork(20.0, 0.0)}, tau=60.0)
    assert out[0].routed_work == pytest.approx(20 / math.e) and out[0].inflight_requests == 0
    assert out[1].routed_work == 0.0 and out[1].inflight_blocks == 4
    assert overlay(views, {}, {}, now=0.0, work={})[0] is views[0]


def test_a_cold_prompt_goes_to_a_node_with_little_work_and_a_held_one_stays_where_it_is_held():
    # a did 55 blocks of prefill lately, b and c 40: cap = 1.25 × (135 + 8) / 3 = 59.6 < 55 + 8.
    fleet = [node("a", 55), node("b", 40), node("c", 40)]
    d = decide(8, fleet, {}, W)
    cand = {c.node_id: c for c in d.candidates}
    assert d.chosen.node_id == "b" and cand["a"].over_bound
    assert "over the load bound: 63 blocks of prefill work, routed lately and this one's > 59.6" in cand["a"].reason
    # The same prompt held by a: nothing to prefill there, 55 ≤ 1.25 × 135 / 3 = 56.25: the cache wins.
    assert decide(8, fleet, {"a": PrefixMatch(gpu=8)}, W).chosen.node_id == "a"
    # With the work bound off, or the load bound off, the work is not looked at.
    assert decide(8, fleet, {}, dataclasses.replace(W, work_bound=0.0)).chosen.node_id == "a"
    assert decide(8, fleet, {}, dataclasses.replace(W, load_bound=0.0)).chosen.node_id == "a"


def test_no_node_within_the_work_bound_leaves_the_least_work_with_this_request():
    d = decide(8, [node("a"), node("b")], {"b": PrefixMatch(gpu=5)}, W)  # nothing routed yet: cap 1.25 × 3 / 2
    assert d.chosen.node_id == "b"


def test_the_work_changes_nothing_with_the_load_bound_off():
    rng = random.Random(7)
    for _ in range(2000):
        total, views, matches = _random_fleet(rng, rng.randint(1, 10))
        worked = [dataclasses.replace(v, routed_work=rng.choice([0.0, 5.0, 80.0, 400.0])) for v in views]
        w = weights(load_bound=0.0, overlap_weight=rng.choice([1.0, 24.0]), work_bound=0.25)
        a, b = decide(total, views, matches, w, random.Random(1)), decide(total, worked, matches, w, random.Random(1))
        assert (a.chosen is None) == (b.chosen is None)
        if a.chosen is not None:
            assert a.chosen.node_id == b.chosen.node_id and a.reason == b.reason
            assert [c.node_id for c in a.ranked()] == [c.node_id for c in b.ranked()]
        assert [(c.cost, c.reason, c.over_bound) for c in a.candidates] == \
               [(c.cost, c.reason, c.over_bound) for c in b.candidates]


def test_a_decisions_work_is_the_prompt_less_what_its_node_held():
    d = decide(8, [node("a"), node("b")], {"a": PrefixMatch(gpu=3, host=2)}, W)
    assert d.chosen.node_id == "a" and routed_work(d.chosen) == 3


def test_the_router_keeps_the_work_it_proxied_and_takes_a_refused_one_back(monkeypatch):
    import routing_api.state
    from tests.routing_api.test_state import state

    # the work decays on the monotonic clock (τ 60 s): hold it still, so a slow machine cannot move it
    monkeypatch.setattr(routing_api.state, "time", SimpleNamespace(monotonic=lambda: 1000.0, time=time.time))
    s = state()
    s.start_proxy("a", 8, 5)("ok")
    assert s.work["a"].value == pytest.approx(5, rel=1e-3)
    s.start_proxy("a", 8, 3)("upstream_error", ran=False)  # refused: never reached the node
    assert s.work["a"].value == pytest.approx(5, rel=1e-3)
    s.start_proxy("b", 8)("ok")  # nothing to prefill: no work
    assert "b" not in s.work
