"""The noise allowance of the load bound (routing_api/bounds.py): a node's share of a few requests in
hand is not imbalance; where shares are many, the (1 + ε) bound is the larger and decides. The work
bound has none."""

from __future__ import annotations

import math

from routing_api.bounds import with_allowance
from routing_api.config import RouterSettings
from routing_api.scoring import DEFAULT_WEIGHTS, NodeView, PrefixMatch, decide
from tests.routing_api.weights import weights


def test_the_allowance_is_on_by_default_and_a_setting():
    assert DEFAULT_WEIGHTS.noise_allowance == 2.0
    assert RouterSettings(noise_allowance=0).weights().noise_allowance == 0.0


def test_a_bound_is_never_tighter_than_the_mean_plus_z_spreads():
    # a mean of 9 blocks, requests of 9: one request's worth of spread (√81 = 9), z = 2: 9 + 18
    assert with_allowance(1.75 * 9, 0.75, 9.0, 2.0) == 27.0
    # a busy fleet: a mean of 900 blocks of requests of 9 (√8100 = 90): 1.75 × 900 = 1575 > 900 + 180
    assert with_allowance(1.75 * 900, 0.75, 9.0, 2.0) == 1575.0
    assert with_allowance(1.75 * 9, 0.75, 9.0, 0.0) == 1.75 * 9  # off
    assert math.isclose(with_allowance(1.25 * 4, 0.25, 1.0, 2.0), 4 + 2 * 2)


def _fleet(loads: tuple[int, int, int]) -> list[NodeView]:
    """Three nodes with ``loads`` blocks in hand, in requests of 8 blocks."""
    return [NodeView(n, f"http://{n}", "live", 100_000, active_blocks=load, active_requests=load // 8, block_size=16)
            for n, load in zip("abc", loads, strict=True)]


def test_a_holder_over_the_bound_by_less_than_the_noise_keeps_its_prefix():
    # a holds the 8-block prompt and has 2 requests of 8 in hand; b and c are idle: the bound alone
    # (1.75 x (16 + 8) / 3 = 14) takes a out; with the allowance (8 + 2 √(8 × 8) = 24) it does not
    matches = {"a": PrefixMatch(gpu=8)}
    bound = decide(8, _fleet((16, 0, 0)), matches, weights(overlap_weight=24.0), block_size=16)
    assert bound.chosen.node_id != "a" and next(c for c in bound.candidates if c.node_id == "a").over_bound
    noisy = decide(8, _fleet((16, 0, 0)), matches, weights(overlap_weight=24.0, noise_allowance=2.0), block_size=16)
    assert noisy.chosen.node_id == "a" and not noisy.chosen.over_bound
    # a hundred times the shares: the imbalance is real, and the (1 + ε) bound decides (1.75 × 802.7 =
    # 1404.7 against 802.7 + 2 √(802.7 × 8) = 963)
    busy = decide(8, _fleet((1600, 400, 400)), matches, weights(overlap_weight=24.0, noise_allowance=2.0),
                  block_size=16)
    assert busy.chosen.node_id != "a" and "> 1404.7" in next(c for c in busy.candidates if c.node_id == "a").reason


def test_the_work_bound_has_no_allowance():
    # a's work lately, 20 blocks, and its 2 blocks to prefill: over 1.25 × (20 + 2) / 3 = 9.17, however
    # few requests those 20 blocks were (with the allowance it would be 9.17 / 1.25 + 2 √(7.33 × 2) = 15.0)
    views = [NodeView(n, f"http://{n}", "live", 100_000, block_size=16, routed_work=work)
             for n, work in zip("abc", (20.0, 0.0, 0.0), strict=True)]
    w = weights(overlap_weight=24.0, work_bound=0.25, noise_allowance=2.0)
    d = decide(10, views, {"a": PrefixMatch(gpu=8)}, w, block_size=16)
    a = next(c for c in d.candidates if c.node_id == "a")
    assert d.chosen.node_id != "a" and a.over_bound and a.reason.endswith("> 9.2")
