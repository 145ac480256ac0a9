"""Routing in the simulator: time to first token, kvflow's bounded loads, and the SGLang and llm-d anchors,
on small exact cases; the routing study's JSON names."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from inference_node.kv.prompt import Prompt
from kvflow.bench.harness import BenchResult
from kvflow.sim.cluster import (
    DYNAMO_OVERLAP_WEIGHT,
    ROUTING,
    SEEDED,
    RouterPolicy,
    SeedMedian,
    SimNode,
    _core,
    percentile,
    simulate,
    simulate_seeds,
)
from kvflow.sim.request import at_load
from kvflow.sim.router_anchors import ApproxTree, LlmdScorer, SGLangCacheAware, _LruIndex
from kvflow.sim.routing import (
    GOALS,
    PEERS,
    POLICIES,
    SEEDS,
    TUNING_FAMILIES,
    _traces,
    routing_figures,
    routing_report,
    run_routing,
)
from kvflow.sim.workloads import BLOCK_TOKENS, SimRequest
from routing_api.scoring import RoutedWork, RoutingWeights

SECOND_PER_BLOCK = 1 / BLOCK_TOKENS  # prefill_s_per_token: one block takes one second


def req(t: float, keys: range | tuple[int, ...], out: int = 0) -> SimRequest:
    return SimRequest(t, tuple(keys), out)


def test_percentile_is_the_nearest_rank():
    assert percentile([], 99) == 0.0
    assert percentile([3.0], 50) == 3.0
    assert percentile([0, 4, 10, 11], 50) == 4 and percentile([0, 4, 10, 11], 99) == 11
    assert percentile(list(range(1, 101)), 99) == 99 and percentile(list(range(1, 101)), 100) == 100


def test_time_to_first_token_on_two_nodes_is_the_wait_plus_the_own_prefill():
    reqs = [req(0, range(1, 11)), req(0, range(101, 105)), req(1, (201, 202)), req(20, range(101, 105))]
    rr = simulate(reqs, nodes=2, capacity=100, routing="round_robin", eviction="lru",
                  prefill_s_per_token=SECOND_PER_BLOCK)
    # n0: r0 prefills 10 s; r2 arrives at 1, waits until 10, prefills 2. n1: r1 4 s; r3 hits all 4 blocks.
    assert rr.ttft_s == [10, 4, 11, 0]
    assert (rr.ttft_p50, rr.ttft_p99) == (4, 11)
    assert rr.mean_queue_s == 9 / 4
    assert rr.requests_per_node == [2, 2] and rr.hit_blocks == 4
    assert rr.prefill_tokens_per_node == [12 * BLOCK_TOKENS, 4 * BLOCK_TOKENS]
    assert rr.max_over_mean_prefill == 12 / 8
    # Pooled: one cache, two servers and one queue: r2 starts on the server r1 frees at 4.
    pooled = simulate(reqs, nodes=2, capacity=100, routing="pooled", eviction="lru",
                      prefill_s_per_token=SECOND_PER_BLOCK)
    assert pooled.ttft_s == [10, 4, 5, 0]
    assert pooled.requests_per_node == [1, 3] and pooled.prefill_tokens_per_node == [10 * 512, 6 * 512]


def test_a_node_holds_its_requests_until_their_last_token_and_reports_the_waiting_ones():
    core, clock = _core(100, "lru")
    nd = SimNode(core, clock, capacity=100)
    assert nd.admit(0.0, 10, 5.0, 2.0) == 0.0  # prefill 0–5, in hand until 7
    assert nd.admit(1.0, 20, 1.0, 0.5) == 5.0  # waits: prefill 5–6, in hand until 6.5
    assert nd.admit(2.0, 30, 1.0, 0.0) == 6.0  # waits: prefill 6–7
    nd.settle(2.0)
    assert (nd.inflight, nd.inflight_blocks, nd.waiting) == (3, 60, 2)
    assert nd.kv_usage == 10 / 100  # the waiting ones hold no blocks
    nd.settle(5.5)
    assert (nd.inflight, nd.waiting, nd.kv_usage) == (3, 1, 30 / 100)  # r0 decodes, r1 prefills
    nd.settle(6.6)
    assert (nd.inflight, nd.inflight_blocks, nd.waiting) == (2, 40, 0)
    nd.settle(7.0)
    assert (nd.inflight, nd.inflight_blocks, nd.waiting, nd.kv_usage) == (0, 0, 0, 0.0)


def _hot(n: int, gap: float) -> list[SimRequest]:
    """A hot prefix of 8 blocks, each request with a fresh block of its own."""
    return [req(i * gap, (*range(1, 9), 1000 + i), 50) for i in range(n)]


def test_a_hot_prefix_is_replicated_to_a_second_node_only_when_its_node_is_over_the_bound():
    w = RoutingWeights(overlap_weight=24.0, noise_allowance=0.0, load_bound=0.75)
    kw: dict[str, Any] = {"nodes": 4, "capacity": 1000, "routing": "kv_aware_load", "eviction": "lru", "weights": w,
                          "prefill_s_per_token": SECOND_PER_BLOCK / 10, "decode_s_per_token": 0.01}
    # Slow traffic: each request finds the fleet idle; the prefix stays on one node, and hits every time after the
    # first (ties at random among idle nodes only for the very first).
    slow = simulate(_hot(40, 10.0), **kw)
    assert sorted(slow.requests_per_node) == [0, 0, 0, 40]
    assert slow.hit_blocks == 8 * 39
    # Fast traffic: its node goes over the bound, the next request goes to another node, which then holds it too.
    fast = simulate(_hot(40, 0.2), **kw)  # ~3 requests in hand at a time
    used = sum(1 for r in fast.requests_per_node if r)
    assert used >= 2
    assert fast.hit_blocks == 8 * (40 - used)  # each node that took the prefix computed it once
    # The cost alone (Dynamo's) keeps every request on the node that holds it.
    dyn = simulate(_hot(40, 0.2), **{**kw, "routing": "dynamo_cost"})
    assert sorted(dyn.requests_per_node) == [0, 0, 0, 40]


def test_dynamos_default_weighs_a_block_to_prefill_as_one_block_of_load():
    # The second request shares the first's 8 blocks while the first is still in hand (decoding) on node 0.
    reqs = [req(0.0, (*range(1, 9), 1000), 50), req(0.1, (*range(1, 9), 1001), 50)]
    kw: dict[str, Any] = {"nodes": 4, "capacity": 1000, "eviction": "lru",
                          "prefill_s_per_token": SECOND_PER_BLOCK / 1000, "decode_s_per_token": 0.01}
    # At kvflow's overlap weight (24) node 0 costs 24 × 1 + 9 = 33 against 24 × 9 = 216 on an idle node.
    heavy = simulate(reqs, routing="dynamo_cost", **kw)
    assert (heavy.requests_per_node, heavy.hit_blocks) == ([2, 0, 0, 0], 8)
    # At Dynamo's own default (1) node 0 costs 1 + 9 = 10 against 9 on an idle node: it balances instead.
    light = simulate(reqs, routing="dynamo_default", **kw)
    assert (light.requests_per_node, light.hit_blocks) == ([1, 1, 0, 0], 0)
    assert DYNAMO_OVERLAP_WEIGHT == 1.0 and "dynamo_default" in PEERS


def test_a_hub_kept_on_its_over_bound_node_is_copied_to_the_idle_one_and_the_next_session_starts_there():
    # Three sessions start with the same 8 blocks (an agent type's tools), each with a block of its own,
    # and stay in hand 10 s (decoding). Prefill: 1 ms a block.
    reqs = [req(0.1 * i, (*range(1, 9), 100 + i), 1000) for i in range(3)]
    kw: dict[str, Any] = {"nodes": 2, "capacity": 1000, "routing": "kv_aware_load", "eviction": "lru",
                          "prefill_s_per_token": SECOND_PER_BLOCK / 1000, "decode_s_per_token": 0.01}
    w = RoutingWeights(overlap_weight=24.0, load_bound=0.75, bound_gate=0.5, hub_fanout=2, noise_allowance=0.0)
    # The first goes to either (a tie, broken at random). The second goes to the same node over the load
    # bound (18 blocks against 0: the gate, 1 block to prefill there against 9), and its prefix is a hub
    # now (blocks 100 and 101 followed it): the other node gets the 8 blocks. The third finds them on
    # both and goes to the other, the less loaded.
    hubs = simulate(reqs, weights=w, **kw)
    holder = hubs.requests_per_node.index(2)
    assert (sorted(hubs.requests_per_node), hubs.hit_blocks, hubs.warmup_tokens) == ([1, 2], 16, 8 * BLOCK_TOKENS)
    assert hubs.prefill_tokens_per_node[holder] == 10 * BLOCK_TOKENS
    assert hubs.prefill_tokens_per_node[1 - holder] == 9 * BLOCK_TOKENS  # the copy is the other's work
    off = simulate(reqs, weights=dataclasses.replace(w, hub_fanout=0), **kw)
    assert (sorted(off.requests_per_node), off.hit_blocks, off.warmup_tokens) == ([0, 3], 16, 0)  # all on one


def test_kv_aware_load_is_the_routers_decide_with_its_load_as_the_router_knows_it():
    nodes = [SimNode(*_core(100, "lru"), capacity=100) for _ in range(3)]
    nodes[0].admit(0.0, 8, 5.0, 0.0)
    nodes[0].admit(0.0, 8, 5.0, 0.0)  # two requests in hand, one waiting
    prompt = Prompt.from_block_keys(range(1, 9), BLOCK_TOKENS)
    nodes[0].core.allocate("x", prompt)
    nodes[0].core.free("x")
    p = RouterPolicy(RoutingWeights(overlap_weight=24.0, load_bound=0.0), random.Random(0))
    assert p.choose(req(0.1, range(1, 9)), prompt, nodes) == 0  # the cost alone: the cache wins
    bound = RoutingWeights(overlap_weight=24.0, noise_allowance=0.0, load_bound=0.75, bound_gate=0.0)
    p = RouterPolicy(dataclasses.replace(bound, hub_fanout=0), random.Random(0))
    assert p.choose(req(0.1, range(1, 9)), prompt, nodes) in (1, 2)  # 16 + 8 queued > 1.75 x 32 / 3
    # with hubs on, the request stays: node 0 holds its 8 blocks (none of them a hub's) and, as this
    # router sees it, has no prefill queue (routing_api.hubs.stay)
    p = RouterPolicy(bound, random.Random(0))
    assert p.choose(req(0.1, range(1, 9)), prompt, nodes) == 0
    # with the bound gate: this router sent node 0 nothing, so it sees no prefill queue there (0 s
    # against 8 blocks elsewhere): the bound costs the request time, and the cache wins again
    p = RouterPolicy(dataclasses.replace(bound, bound_gate=0.5), random.Random(0))
    assert p.choose(req(0.1, range(1, 9)), prompt, nodes) == 0


def test_the_router_policy_keeps_the_prefill_work_it_routed_as_the_router_does():
    nodes = [SimNode(*_core(100, "lru"), capacity=100) for _ in range(2)]
    held = Prompt.from_block_keys(range(1, 9), BLOCK_TOKENS)
    nodes[1].core.allocate("x", held)
    nodes[1].core.free("x")
    w = RoutingWeights(overlap_weight=24.0, noise_allowance=0.0, load_bound=0.75, work_bound=0.25, work_tau_s=10.0)
    p = RouterPolicy(w, random.Random(0))
    more = Prompt.from_block_keys(range(1, 13), BLOCK_TOKENS)  # 8 blocks held on node 1, 4 more
    assert p.choose(req(0.0, range(1, 13)), more, nodes) == 1
    assert p.work == {"1": RoutedWork(4.0, 0.0)}  # the uncached blocks only
    # Node 1 has done 4 blocks lately (4/e after 10 s): a cold prompt of 2 goes to node 0
    # (4/e + 2 > 1.25 x (4/e + 2) / 2).
    assert p.choose(req(10.0, (50, 51)), Prompt.from_block_keys((50, 51), BLOCK_TOKENS), nodes) == 0
    assert p.work["0"] == RoutedWork(2.0, 10.0)


def test_sglangs_tree_matches_the_longest_prefix_and_evicts_least_recently_used_leaves():
    tree = ApproxTree(3)
    tree.insert((1, 2, 3), 0, 1.0)
    tree.insert((1, 2, 9), 1, 2.0)
    assert tree.size == [3, 3, 0]
    assert tree.prefix_match((1, 2, 3, 4), 3.0) == (3, 0)
    assert tree.prefix_match((1, 2, 7), 4.0) == (2, 0)  # the first worker of the deepest node matched
    assert tree.prefix_match((5,), 4.0)[0] == 0
    assert tree.smallest() == 2
    tree.insert((1, 2, 3), 2, 5.0)
    tree.insert((1, 4), 2, 6.0)
    tree.evict(2)  # every worker cut back to 2 blocks, its least recently used leaves first
    assert tree.size == [2, 2, 2]
    assert tree.prefix_match((1, 2, 9), 7.0) == (2, 0)  # worker 1 lost its leaf 9, the only holder
    assert tree.prefix_match((1, 2, 3), 7.0) == (2, 0)  # 3's holders 0 and 2 lost it (2: older than 4)
    assert tree.prefix_match((1, 4), 7.0) == (2, 2)


def test_sglang_routes_by_match_rate_then_smallest_tree_and_by_shortest_queue_when_imbalanced():
    p = SGLangCacheAware(3)
    idle = [SimpleNamespace(inflight=0) for _ in range(3)]
    pr = Prompt.from_block_keys([1], BLOCK_TOKENS)  # unused by the policy (it matches keys)
    assert p.choose(req(0, (1, 2, 3, 4)), pr, idle) == 0    # no match: the smallest tree (all empty: the first)
    assert p.choose(req(1, (1, 2, 3, 4)), pr, idle) == 0    # 4/4 > 0.3: the match
    assert p.choose(req(2, (1, 2, 5, 6, 7, 8, 9)), pr, idle) == 1  # 2/7 = 0.29 <= 0.3: the smallest tree
    assert p.choose(req(3, (1, 2, 5, 6, 7)), pr, idle) == 1  # 5/5 on worker 1 now
    assert p.imbalanced([70, 0, 3]) and not p.imbalanced([70, 10, 10]) and not p.imbalanced([200, 150, 150])
    loaded = [SimpleNamespace(inflight=n) for n in (70, 3, 0)]
    assert p.choose(req(4, (1, 2, 3, 4)), pr, loaded) == 2  # imbalanced: the shortest queue, whatever matches
    assert p.choose(req(5, (1, 2, 3, 4)), pr, [SimpleNamespace(inflight=n) for n in (70, 10, 10)]) in (0, 2)
    assert p.tree.prefix_match((1, 2, 3, 4), 6.0) == (4, 0)


def test_sglang_cuts_its_trees_back_at_each_interval():
    p = SGLangCacheAware(2, max_tree_size_chars=3 * BLOCK_TOKENS * 4, eviction_interval_s=10.0)
    idle = [SimpleNamespace(inflight=0) for _ in range(2)]
    pr = Prompt.from_block_keys([1], BLOCK_TOKENS)
    p.choose(req(0, range(1, 11)), pr, idle)
    assert p.tree.size[0] == 10
    p.choose(req(11, (50,)), pr, idle)  # the eviction at 10 s ran first
    assert p.tree.size[0] == 3 and p.max_blocks == 3


def test_llm_ds_index_is_an_lru_per_server_of_what_was_routed():
    idx = _LruIndex(2, 2)
    idx.add([b"a", b"b", b"c"], 0)
    assert list(idx.lru[0]) == [b"b", b"c"] and b"a" not in idx.holders
    assert idx.match([b"a", b"b"]) == Counter()  # the prefix stops at the first hash nobody holds
    idx.add([b"b"], 1)
    assert idx.match([b"b", b"c", b"d"]) == Counter({0: 2, 1: 1})


def test_llm_ds_scorers_weigh_prefix_3_queue_2_kv_usage_2_and_the_highest_wins():
    p = LlmdScorer(3, 1000, random.Random(0))
    prompt = Prompt.from_block_keys(range(1, 5), BLOCK_TOKENS)
    p.index.add(prompt.digests[:2], 1)  # server 1 was sent the first 2 of the 4 blocks
    nodes = [SimpleNamespace(waiting=q, kv_usage=u) for q, u in ((0, 0.5), (2, 0.0), (4, 0.0))]
    # prefix 0, 1/2, 0; queue (4 - q) / 4: 1, 1/2, 0; KV 1 - usage: 1/2, 1, 1
    assert p.scores(prompt, nodes) == [pytest.approx(3.0), pytest.approx(4.5), pytest.approx(2.0)]
    assert p.choose(req(0, range(1, 5)), prompt, nodes) == 1
    assert p.index.match(prompt.digests) == Counter({1: 4})  # what it routed is indexed
    same = [SimpleNamespace(waiting=0, kv_usage=0.0) for _ in range(3)]
    other = Prompt.from_block_keys(range(50, 53), BLOCK_TOKENS)
    picks = Counter(LlmdScorer(3, 1000, random.Random(i)).choose(req(0, range(50, 53)), other, same)
                    for i in range(300))
    assert set(picks) == {0, 1, 2}  # ties at random


def test_a_seeded_policy_reports_the_median_of_each_figure_over_its_seeds():
    rng = random.Random(7)  # many equal prefixes: the cheapest nodes tie often
    reqs = [req(i * 0.05, tuple(rng.choice(((1, 2), (1, 3), (4, 5))) + (100 + i,)), 20) for i in range(300)]
    kw: dict[str, Any] = {"nodes": 4, "capacity": 8, "eviction": "lru", "prefill_s_per_token": 1e-4,
                          "decode_s_per_token": 0.02}
    runs = [simulate(reqs, routing="kv_aware_load", seed=s, **kw) for s in range(3)]
    assert len({tuple(r.ttft_s) for r in runs}) > 1  # the seed matters here
    med = simulate_seeds(reqs, seeds=3, routing="kv_aware_load", **kw)
    assert isinstance(med, SeedMedian) and len(med.runs) == 3
    for fig in ("hit_rate", "ttft_p50", "ttft_p99", "max_over_mean_prefill", "max_over_mean_requests", "mean_queue_s"):
        assert getattr(med, fig) == sorted(getattr(r, fig) for r in runs)[1], fig
    assert [x["ttft_p99_s"] for x in med.as_dict()["seeds"]] == [round(r.ttft_p99, 4) for r in runs]  # type: ignore[index]
    assert med.as_dict()["hit_rate"] == round(med.hit_rate, 5)
    one = simulate_seeds(reqs, seeds=3, routing="sglang", **kw)  # it draws nothing at random: one run
    assert not isinstance(one, SeedMedian) and one.ttft_s == simulate(reqs, routing="sglang", **kw).ttft_s
    assert set(SEEDED) == {"random", "llm_d", "kv_aware_load"}


def test_every_policy_runs_and_the_study_reports_the_issues_names(tmp_path):
    study = run_routing(limit=300, generator_requests=300, capacities=(100, 200), workers=1)
    assert study.seeds == SEEDS == 3
    assert isinstance(study.row("mooncake", 100, "kv_aware_load"), SeedMedian)
    assert not isinstance(study.row("mooncake", 100, "dynamo_cost"), SeedMedian)
    assert set(study.traces) >= {"mooncake", "hot_prefixes", "one_shot"}
    assert {p for (_, _, p) in study.rows} == set(POLICIES) == {"pooled", *ROUTING}
    assert study.vs_pooled("one_shot", 100, "kv_aware_load") is None  # pooled hits nothing there
    res = BenchResult("sim")
    routing_figures(res, study, 200)
    for name in ("kv_aware_vs_pooled_hit_rate_min", "kv_aware_ttft_p99_vs_round_robin_max",
                 "kv_aware_ttft_p99_vs_least_loaded_max", "kv_aware_vs_pooled_hit_rate",
                 "round_robin_vs_pooled_hit_rate",
                 "sglang_vs_pooled_hit_rate_min", "llm_d_vs_pooled_hit_rate_min", "kv_aware_vs_pooled_hit_rate_100",
                 "kv_aware_vs_pooled_hit_rate_min.hot_prefixes", "kv_aware_ttft_p99_vs_round_robin_max.one_shot"):
        assert name in res.ratios, name
    for name in ("kv_aware_max_over_mean_load_worst_capacity", "kv_aware_max_over_mean_load",
                 "kv_aware_max_over_mean_load_worst_capacity.hot_prefixes", "kv_aware_ttft_p99_s"):
        assert name in res.figures, name
    assert "kv_aware_vs_pooled_hit_rate_min.one_shot" not in res.ratios
    worst = max(study.row(t, c, "kv_aware_load").max_over_mean_prefill for t in study.traces for c in (100, 200))
    assert res.figures["kv_aware_max_over_mean_load_worst_capacity"] == worst
    assert all(res.goals[k] == v for k, v in GOALS.items())
    report = routing_report(study)
    assert sum(1 for line in report if line.startswith("| hot_prefixes | 100 |")) == len(POLICIES)
    assert any(line.startswith("| one_shot | validation | — |") for line in report)
    assert any(line.startswith("| agentic | tuning |") for line in report)
    # against the best peer on each figure (Dynamo's cost, SGLang's, llm-d's), every trace and capacity
    for t in study.traces:
        for c in (100, 200):
            me, peers = study.row(t, c, "kv_aware_load"), [study.row(t, c, p) for p in PEERS]
            best = max(p.hit_rate for p in peers)
            assert res.ratios[f"kv_aware_vs_best_peer_hit_rate.{t}.{c}"] == (me.hit_rate / best if best else 1.0)
            assert res.ratios[f"kv_aware_ttft_p99_vs_best_peer.{t}.{c}"] == me.ttft_p99 / min(p.ttft_p99 for p in peers)
    cells = [res.ratios[f"kv_aware_ttft_p50_vs_best_peer.{t}.{c}"] for t in study.traces for c in (100, 200)]
    assert res.ratios["kv_aware_ttft_p50_vs_best_peer_max"] == max(cells)
    tuning = [res.ratios[f"kv_aware_vs_best_peer_hit_rate.{t}.{c}"] for t in TUNING_FAMILIES for c in (100, 200)]
    assert res.ratios["kv_aware_vs_best_peer_hit_rate_min.tuning"] == min(tuning)
    assert "kv_aware_vs_best_peer_hit_rate_min.validation" in res.ratios
    # the share of kvflow's prefill tokens that were hub copies (routing_api.hubs), worst over every run
    runs = [study.row(t, c, "kv_aware_load") for t in study.traces for c in (100, 200)]
    shares = [r.warmup_tokens / sum(r.prefill_tokens_per_node) for r in runs if sum(r.prefill_tokens_per_node)]
    assert res.figures["kv_aware_warmup_share_max"] == max(shares)
    assert "kv_aware_warmup_share_max.agentic" in res.figures


def test_a_lighter_load_stretches_every_gap_and_a_queued_request_no_longer_waits():
    reqs = [req(0, range(1, 5)), req(2, range(11, 13)), req(3, (21,))]
    light = at_load(reqs, 0.5)
    assert [r.t for r in light] == [0, 4, 6] and [r.keys for r in light] == [r.keys for r in reqs]
    assert at_load(reqs, 1) == reqs
    with pytest.raises(ValueError, match="load must be positive"):
        at_load(reqs, 0)
    # one node, one block a second: at its own load the second request waits 2 s behind the first's
    # 4-block prefill and the third 1 s behind the second; at half the load neither waits
    kw: dict[str, Any] = {"nodes": 1, "capacity": 100, "routing": "round_robin", "eviction": "lru",
                          "prefill_s_per_token": SECOND_PER_BLOCK}
    assert simulate(reqs, **kw).ttft_s == [4, 4, 4]
    assert simulate(light, **kw).ttft_s == [4, 2, 1]


def test_the_study_at_another_load_runs_every_trace_at_it_and_says_so():
    own, light = _traces(None, 60, 60), _traces(None, 60, 60, load=2 / 3)
    assert own.keys() == light.keys()
    for name in own:
        a, b = own[name](), light[name]()
        assert [r.keys for r in b] == [r.keys for r in a], name
        assert [r.t for r in b] == pytest.approx([r.t * 1.5 for r in a]), name
    study = run_routing(limit=60, generator_requests=60, capacities=(100,), workers=1, seeds=1, load=0.5)
    assert study.load == 0.5
    res = BenchResult("sim")
    routing_figures(res, study, 100)
    assert res.details["routing"]["load"] == 0.5
    assert routing_report(study)[0] == "## Routing: 8 nodes, every trace at 0.5 × its load (every arrival time ÷ 0.5)"
