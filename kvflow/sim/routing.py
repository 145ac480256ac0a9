"""The routing experiments of ``kvflow sim``: every routing policy × trace × capacity, with time.

Traces: the Mooncake conversation trace (or ``--trace FILE``) and every family of
:data:`kvflow.sim.workloads.GENERATORS`, on 8 nodes of 500 / 1,000 / 2,000 blocks. Policies:
:data:`kvflow.sim.cluster.ROUTING` and ``pooled`` (one cache of 8 × the capacity, 8 servers: the
ceiling). Each run reports the hit rate, its ratio to pooled, the busiest node's requests and
prefill tokens over the mean, and the time to first token (p50 / p99) of the queueing model of
:mod:`kvflow.sim.cluster`: prefill at ``PREFILL_S_PER_TOKEN`` (10k tokens/s per node), FIFO, and
each request in hand — counted by the router — until its last token at ``DECODE_S_PER_TOKEN``.

kvflow's policy (``kv_aware_load``) is :func:`routing_api.scoring.decide` with the router's default
weights (:data:`SIM_WEIGHTS` is :data:`~routing_api.scoring.DEFAULT_WEIGHTS`), then the bound gate
and the queue tiebreak (:func:`routing_api.prefill.gate`), hubs (:mod:`routing_api.hubs`: a session
kept where its context is, a hub's copy prefilled on its target node and counted in its prefill
tokens) and the tail guard (:func:`routing_api.prefill.guard`). The policies that break ties at
random (kvflow's, llm-d's, random: :data:`~kvflow.sim.cluster.SEEDED`) run at :data:`SEEDS` seeds and
each of their figures is the median (:class:`~kvflow.sim.cluster.SeedMedian`;
``details.routing.runs[…].seeds`` holds every seed's). The runs are independent: they are spread
over processes (one task per trace and capacity).

JSON (``BenchResult``): on the Mooncake trace at the reference capacity, as before,
``ratios.kv_aware_vs_pooled_hit_rate``, ``round_robin_…``, ``random_…``, ``figures.kv_aware_max_over_mean_load``
(the larger of requests and prefill tokens) …; over every trace and capacity (one_shot, where
pooled hits nothing, has no ratio): ``ratios.kv_aware_vs_pooled_hit_rate_min`` (goal ≥ 0.95),
``figures.kv_aware_max_over_mean_load_worst_capacity`` (the busiest node's prefill tokens over the
mean; goal ≤ 1.15), ``ratios.kv_aware_ttft_p99_vs_round_robin_max`` and ``…_vs_least_loaded_max``
(goal ≤ 1), the same per trace (``….<trace>``) and the anchors' (``sglang_…``, ``llm_d_…``);
against the best of :data:`PEERS` on each figure (issue 41's goals), per trace and capacity
``ratios.kv_aware_vs_best_peer_hit_rate.<trace>.<cap>`` (≥ 0.98), ``kv_aware_ttft_p50_vs_best_peer.…``
(≤ 1.05), ``kv_aware_ttft_p99_vs_best_peer.…`` (≤ 1), their worst (``…_min`` / ``…_max``), and the
same over the tuning and the validation traces apart (``….tuning``, ``….validation``;
:data:`TUNING_FAMILIES`); the share of kvflow's prefill tokens that were hub copies,
``figures.kv_aware_warmup_share_max`` and per trace (each run's ``warmup_tokens``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.bench.harness import BenchResult
from kvflow.sim.cluster import ROUTING, SEEDED, SimResult, simulate_seeds
from kvflow.sim.request import at_load
from kvflow.sim.workloads import GENERATORS, SimRequest, mooncake
from routing_api.scoring import DEFAULT_WEIGHTS, RoutingWeights

#: Prefill 10k tokens/s per node.
PREFILL_S_PER_TOKEN = 1e-4
#: Decode at 50 tokens/s (the families' own assumption: agentic steps are decoded at 50 tokens/s):
#: how long a request stays in hand after its prefill, as the router counts it.
DECODE_S_PER_TOKEN = 0.02
#: The router's weights in the simulator: the router's own defaults, so that what ``kvflow sim``
#: reports as kvflow is what ``kvflow router`` runs with no settings (``tests/kvflow/test_sim_routing.py``
#: holds them equal): a cached block worth 24 blocks of load (the cost follows the cache, the
#: bound keeps the balance), the load bound 0.75, the bound on prefill work routed lately (0.25,
#: τ 60 s), chosen on the Mooncake trace, multi_turn, agentic and hot_prefixes; and the tail guard
#: (quantile 0.9, its tolerance 0.35 and work slack 1.1), chosen on the Mooncake trace and the first
#: eight families; the bound gate (0.5) and the queue tiebreak, chosen on :data:`TUNING_FAMILIES`
#: (docs/router.md, "Which data chose each default").
SIM_WEIGHTS = DEFAULT_WEIGHTS
POLICIES = ("pooled", *ROUTING)
#: Where the goals are judged: every trace, every capacity.
GOALS = {"kv_aware_vs_pooled_hit_rate_min": ">= 0.95", "kv_aware_max_over_mean_load_worst_capacity": "<= 1.15",
         "kv_aware_ttft_p99_vs_round_robin_max": "<= 1", "kv_aware_ttft_p99_vs_least_loaded_max": "<= 1",
         "kv_aware_vs_best_peer_hit_rate_min": ">= 0.98", "kv_aware_ttft_p50_vs_best_peer_max": "<= 1.05",
         "kv_aware_ttft_p99_vs_best_peer_max": "<= 1"}
#: The peers kvflow's policy is held against: Dynamo's cost (at kvflow's overlap weight and at Dynamo's
#: own default, 1), SGLang's and llm-d's (the best of them on each figure, trace and capacity).
PEERS = ("dynamo_cost", "dynamo_default", "sglang", "llm_d")
#: The policies that break ties at random (:data:`~kvflow.sim.cluster.SEEDED`: kvflow's, llm-d's,
#: random) run at this many seeds, each figure the median: one seed's cell is one draw (the Mooncake
#: trace at 2,000 blocks moved between 0.964 and 1.012 of the best peer's hit rate with the seed).
SEEDS = 3
#: The generated families the defaults new in issue 41 (the bound gate 0.5, the queue tiebreak) were
#: chosen on, at their default seeds; every other family, these at other seeds and the Mooncake
#: trace validate them (docs/router.md, "Which data chose each default").
TUNING_FAMILIES = ("system_prompt", "agentic", "rag", "scan", "bursts", "long_tail")


@dataclass
class RoutingStudy:
    """Every run: ``rows[(trace, capacity, policy)]``."""

    traces: list[str]
    capacities: tuple[int, ...]
    nodes: int
    #: the seeds each seeded policy ran at (its figures: their medians)
    seeds: int = 1
    #: the multiple of each trace's own load it ran at (:func:`~kvflow.sim.request.at_load`)
    load: float = 1.0
    rows: dict[tuple[str, int, str], SimResult] = field(default_factory=dict)

    def row(self, trace: str, cap: int, policy: str) -> SimResult:
        return self.rows[(trace, cap, policy)]

    def vs_pooled(self, trace: str, cap: int, policy: str) -> float | None:
        """The hit rate over pooled's (None where pooled hits nothing)."""
        pooled = self.row(trace, cap, "pooled").hit_rate
        return self.row(trace, cap, policy).hit_rate / pooled if pooled else None


def _traces(trace: str | None, limit: int | None, generator_requests: int,
            load: float = 1.0) -> dict[str, Callable[[], list[SimRequest]]]:
    """Every trace of the study by name, each at ``load`` × its own load."""
    out: dict[str, Callable[[], list[SimRequest]]] = {"mooncake": lambda: at_load(mooncake(trace, limit), load)}
    for name, gen in GENERATORS.items():
        out[name] = lambda gen=gen: at_load(gen(generator_requests), load)  # type: ignore[misc]
    return out


def _task(args: tuple[str, int, str | None, int | None, int, int, RoutingWeights, int, float]) -> list[SimResult]:
    """One trace at one capacity: pooled and every policy (a seeded one at ``seeds`` seeds, the medians)."""
    name, cap, trace, limit, generator_requests, nodes, weights, seeds, load = args
    reqs = _traces(trace, limit, generator_requests, load)[name]()
    return [simulate_seeds(reqs, seeds=seeds, nodes=nodes, capacity=cap, routing=p, eviction="lru", workload=name,
                           prefill_s_per_token=PREFILL_S_PER_TOKEN, decode_s_per_token=DECODE_S_PER_TOKEN,
                           weights=weights) for p in POLICIES]


def run_routing(*, trace: str | None = None, limit: int | None = None, generator_requests: int = 6000,
                nodes: int = 8, capacities: tuple[int, ...] = (500, 1000, 2000),
                weights: RoutingWeights = SIM_WEIGHTS, workers: int | None = None, seeds: int = SEEDS,
                load: float = 1.0, step: Callable[[str], None] = lambda _m: None) -> RoutingStudy:
    """Run every policy on every trace at every capacity (``workers`` processes; default: the CPUs), the
    seeded ones at ``seeds`` seeds (each figure the median), every trace at ``load`` × its own load
    (:func:`~kvflow.sim.request.at_load`: the defaults were chosen at 1)."""
    names = list(_traces(trace, limit, generator_requests, load))
    study = RoutingStudy(names, capacities, nodes, seeds, load)
    tasks = [(name, cap, trace, limit, generator_requests, nodes, weights, seeds, load)
             for name in names for cap in capacities]
    n = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    results: list[list[SimResult]] = []
    if n == 1:
        for t in tasks:
            step(f"routing: {t[0]} at {nodes} x {t[1]}")
            results.append(_task(t))
    else:
        with ProcessPoolExecutor(n) as pool:
            for i, r in enumerate(pool.map(_task, tasks)):
                step(f"routing: {i + 1}/{len(tasks)} ({tasks[i][0]} at {nodes} x {tasks[i][1]})")
                results.append(r)
    for t, runs in zip(tasks, results, strict=True):
        for run in runs:
            study.rows[(t[0], t[1], run.routing)] = run
    return study


def _worst(study: RoutingStudy, policy: str, traces: Sequence[str]) -> dict[str, float]:
    """A policy's worst figures over ``traces`` and every capacity."""
    hit = [v for t in traces for c in study.capacities if (v := study.vs_pooled(t, c, policy)) is not None]
    rows = [study.row(t, c, policy) for t in traces for c in study.capacities]
    out = {"vs_pooled_hit_rate_min": min(hit) if hit else 1.0,
           "max_over_mean_prefill_worst": max(r.max_over_mean_prefill for r in rows),
           "max_over_mean_requests_worst": max(r.max_over_mean_requests for r in rows)}
    for base in ("round_robin", "least_loaded"):
        out[f"ttft_p99_vs_{base}_max"] = max(
            study.row(t, c, policy).ttft_p99 / max(study.row(t, c, base).ttft_p99, 1e-9)
            for t in traces for c in study.capacities)
    return out


def vs_best_peer(study: RoutingStudy, trace: str, cap: int, policy: str = "kv_aware_load") -> dict[str, float]:
    """A policy against the best of :data:`PEERS` on each figure, at one trace and capacity: its hit rate
    over the best peer's (1 where no peer hits), its TTFT p50 and p99 over the lowest peer's."""
    me = study.row(trace, cap, policy)
    peers = [study.row(trace, cap, p) for p in PEERS]
    hit = max(p.hit_rate for p in peers)
    p50 = min(p.ttft_p50 for p in peers)
    p99 = min(p.ttft_p99 for p in peers)
    return {"hit_rate": me.hit_rate / hit if hit else 1.0, "ttft_p50": me.ttft_p50 / p50 if p50 else 1.0,
            "ttft_p99": me.ttft_p99 / p99 if p99 else 1.0}


def best_peer_figures(res: BenchResult, study: RoutingStudy) -> None:
    """kvflow against the best peer on every trace and capacity (``ratios.kv_aware_vs_best_peer_….<trace>.<cap>``)
    and the worst of them (``…_min`` / ``…_max``, the goals), also over the tuning and the validation
    traces apart (``….tuning`` / ``….validation``)."""
    cells = {(t, c): vs_best_peer(study, t, c) for t in study.traces for c in study.capacities}
    for (t, c), v in cells.items():
        res.ratios[f"kv_aware_vs_best_peer_hit_rate.{t}.{c}"] = v["hit_rate"]
        res.ratios[f"kv_aware_ttft_p50_vs_best_peer.{t}.{c}"] = v["ttft_p50"]
        res.ratios[f"kv_aware_ttft_p99_vs_best_peer.{t}.{c}"] = v["ttft_p99"]
    halves = {"": study.traces, ".tuning": [t for t in study.traces if t in TUNING_FAMILIES],
              ".validation": [t for t in study.traces if t not in TUNING_FAMILIES]}
    for suffix, traces in halves.items():
        vs = [cells[(t, c)] for t in traces for c in study.capacities]
        if not vs:
            continue
        res.ratios[f"kv_aware_vs_best_peer_hit_rate_min{suffix}"] = min(v["hit_rate"] for v in vs)
        res.ratios[f"kv_aware_ttft_p50_vs_best_peer_max{suffix}"] = max(v["ttft_p50"] for v in vs)
        res.ratios[f"kv_aware_ttft_p99_vs_best_peer_max{suffix}"] = max(v["ttft_p99"] for v in vs)


def routing_figures(res: BenchResult, study: RoutingStudy, reference: int) -> None:
    """The JSON names (module docstring) into ``res``."""
    ref = reference if reference in study.capacities else study.capacities[len(study.capacities) // 2]
    mc = "mooncake"
    kv, pooled = study.row(mc, ref, "kv_aware_load"), study.row(mc, ref, "pooled")
    for cap in study.capacities:
        res.ratios[f"kv_aware_vs_pooled_hit_rate_{cap}"] = study.vs_pooled(mc, cap, "kv_aware_load") or 1.0
    res.ratios["kv_aware_vs_pooled_hit_rate"] = study.vs_pooled(mc, ref, "kv_aware_load") or 1.0
    for p in ("round_robin", "random", "least_loaded", "dynamo_cost", "dynamo_default", "sglang", "llm_d"):
        res.ratios[f"{p}_vs_pooled_hit_rate"] = study.vs_pooled(mc, ref, p) or 1.0
    res.figures["kv_aware_max_over_mean_load"] = max(kv.max_over_mean_requests, kv.max_over_mean_prefill)
    res.figures["kv_aware_max_over_mean_requests"] = kv.max_over_mean_requests
    res.figures["kv_aware_max_over_mean_prefill_tokens"] = kv.max_over_mean_prefill
    res.figures["kv_aware_hit_rate"] = kv.hit_rate
    res.figures["kv_aware_ttft_p50_s"] = kv.ttft_p50
    res.figures["kv_aware_ttft_p99_s"] = kv.ttft_p99
    res.baseline["pooled_lru_hit_rate"] = pooled.hit_rate
    for policy, prefix in (("kv_aware_load", "kv_aware"), ("sglang", "sglang"), ("llm_d", "llm_d"),
                           ("dynamo_cost", "dynamo_cost"), ("dynamo_default", "dynamo_default")):
        w = _worst(study, policy, study.traces)
        res.ratios[f"{prefix}_vs_pooled_hit_rate_min"] = w["vs_pooled_hit_rate_min"]
        res.figures[f"{prefix}_max_over_mean_load_worst_capacity"] = w["max_over_mean_prefill_worst"]
        res.figures[f"{prefix}_max_over_mean_requests_worst_capacity"] = w["max_over_mean_requests_worst"]
        res.ratios[f"{prefix}_ttft_p99_vs_round_robin_max"] = w["ttft_p99_vs_round_robin_max"]
        res.ratios[f"{prefix}_ttft_p99_vs_least_loaded_max"] = w["ttft_p99_vs_least_loaded_max"]
    for t in study.traces:
        w = _worst(study, "kv_aware_load", [t])
        if any(study.vs_pooled(t, c, "kv_aware_load") is not None for c in study.capacities):
            res.ratios[f"kv_aware_vs_pooled_hit_rate_min.{t}"] = w["vs_pooled_hit_rate_min"]
        res.figures[f"kv_aware_max_over_mean_load_worst_capacity.{t}"] = w["max_over_mean_prefill_worst"]
        res.ratios[f"kv_aware_ttft_p99_vs_round_robin_max.{t}"] = w["ttft_p99_vs_round_robin_max"]
        res.ratios[f"kv_aware_ttft_p99_vs_least_loaded_max.{t}"] = w["ttft_p99_vs_least_loaded_max"]
        res.figures[f"kv_aware_warmup_share_max.{t}"] = max(_warmup_share(study.row(t, c, "kv_aware_load"))
                                                             for c in study.capacities)
    res.figures["kv_aware_warmup_share_max"] = max(_warmup_share(study.row(t, c, "kv_aware_load"))
                                                   for t in study.traces for c in study.capacities)
    best_peer_figures(res, study)
    res.goals.update(GOALS)
    res.goals.update({"kv_aware_vs_pooled_hit_rate": ">= 0.95", "kv_aware_max_over_mean_load": "<= 1.15"})
    res.details["routing"] = {
        "traces": study.traces, "capacities": list(study.capacities), "nodes": study.nodes,
        "reference_capacity": ref, "policies": list(POLICIES), "weights": dataclasses.asdict(SIM_WEIGHTS),
        "peers": list(PEERS), "seeds": study.seeds, "seeded_policies": list(SEEDED), "load": study.load,
        "tuning_traces": [t for t in study.traces if t in TUNING_FAMILIES],
        "prefill_s_per_token": PREFILL_S_PER_TOKEN, "decode_s_per_token": DECODE_S_PER_TOKEN,
        "runs": [r.as_dict() for r in study.rows.values()]}


def _warmup_share(r: SimResult) -> float:
    """The share of a run's prefill tokens that were the router's hub copies (``routing_api.hubs``)."""
    total = sum(r.prefill_tokens_per_node)
    return r.warmup_tokens / total if total else 0.0


def _cell(v: float | None, fmt: str = ".3f") -> str:
    return "—" if v is None else format(v, fmt)


def routing_report(study: RoutingStudy) -> list[str]:
    """The report's routing section: the goals per trace, then every run."""
    at = f" at {study.load:g} × its load (every arrival time ÷ {study.load:g})" if study.load != 1 else ""
    lines = [f"## Routing: {study.nodes} nodes, every trace{at}", "",
             f"Prefill {1 / PREFILL_S_PER_TOKEN:,.0f} tokens/s per node (FIFO), "
             + (f"decode {1 / DECODE_S_PER_TOKEN:.0f} tokens/s" if DECODE_S_PER_TOKEN else "decode not counted")
             + "; kvflow = `kv_aware_load` (the router's `decide`, load bound "
             f"ε = {SIM_WEIGHTS.load_bound}, work bound {SIM_WEIGHTS.work_bound} over "
             f"τ = {SIM_WEIGHTS.work_tau_s:g} s, "
             f"overlap weight {SIM_WEIGHTS.overlap_weight:g}, tail guard at the p{SIM_WEIGHTS.ttft_quantile * 100:g} "
             f"of predicted TTFT, tolerance {SIM_WEIGHTS.ttft_tolerance:g}, work slack "
             f"{SIM_WEIGHTS.ttft_work_slack:g}; bound gate {SIM_WEIGHTS.bound_gate:g}, queue tiebreak "
             f"{'on' if SIM_WEIGHTS.queue_tiebreak else 'off'}, hub fanout {SIM_WEIGHTS.hub_fanout}). "
             f"Peers: {', '.join(PEERS)} (the best of them on each figure). {', '.join(SEEDED)}: each figure "
             f"the median over {study.seeds} seeds of their random tiebreak. Worst over capacities "
             f"{', '.join(f'{c:,}' for c in study.capacities)}:", "",
             "| trace | half | kvflow vs pooled (min) | busiest / mean prefill (worst) | "
             "TTFT p99 vs round-robin (max) | "
             "vs least-loaded (max) | hit rate vs best peer (min) | TTFT p50 vs best peer (max) | "
             "TTFT p99 vs best peer (max) |", "| --- | --- |" + " ---: |" * 7]
    for t in study.traces:
        w = _worst(study, "kv_aware_load", [t])
        has = any(study.vs_pooled(t, c, "kv_aware_load") is not None for c in study.capacities)
        peer = [vs_best_peer(study, t, c) for c in study.capacities]
        lines.append(f"| {t} | {'tuning' if t in TUNING_FAMILIES else 'validation'} | "
                     f"{_cell(w['vs_pooled_hit_rate_min'] if has else None)} | "
                     f"{w['max_over_mean_prefill_worst']:.3f} | {w['ttft_p99_vs_round_robin_max']:.3f} | "
                     f"{w['ttft_p99_vs_least_loaded_max']:.3f} | {min(p['hit_rate'] for p in peer):.3f} | "
                     f"{max(p['ttft_p50'] for p in peer):.3f} | {max(p['ttft_p99'] for p in peer):.3f} |")
    lines += ["", "Every run (hit rate; its ratio to pooled; busiest node over the mean, requests and prefill "
              "tokens; time to first token):", "",
              "| trace | blocks per node | routing | hit rate | vs pooled | max/mean requests | max/mean prefill | "
              "TTFT p50 s | TTFT p99 s |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in study.traces:
        for cap in study.capacities:
            for p in POLICIES:
                r = study.row(t, cap, p)
                lines.append(f"| {t} | {cap:,} | {p} | {r.hit_rate:.4f} | {_cell(study.vs_pooled(t, cap, p))} | "
                             f"{r.max_over_mean_requests:.3f} | {r.max_over_mean_prefill:.3f} | {r.ttft_p50:.3f} | "
                             f"{r.ttft_p99:.3f} |")
    return lines


def plot_load_balance(out_dir: Path, study: RoutingStudy, reference: int) -> None:
    """``load_balance.png``: per policy, the worst hit rate against pooled and the worst busiest node
    over the mean (prefill tokens, requests) over every trace and capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ROUTING)
    worst = {p: _worst(study, p, study.traces) for p in names}
    colors = ["#bbb"] * (len(names) - 1) + ["#e0533d"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    axes[0].bar(names, [worst[p]["vs_pooled_hit_rate_min"] for p in names], color=colors)
    axes[0].axhline(0.95, color="#e0533d", linestyle="--", linewidth=1, label="0.95")
    axes[0].set_title(f"hit rate / pooled, worst over {len(study.traces)} traces x {len(study.capacities)} capacities")
    axes[0].tick_params(axis="x", rotation=30)
    axes[0].legend()
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [worst[p]["max_over_mean_requests_worst"] for p in names], width=0.4,
                label="requests")
    axes[1].bar([i + 0.2 for i in x], [worst[p]["max_over_mean_prefill_worst"] for p in names], width=0.4,
                label="prefill tokens")
    axes[1].axhline(1.15, color="#e0533d", linestyle="--", linewidth=1, label="1.15")
    axes[1].set_xticks(list(x), names, rotation=30)
    axes[1].set_yscale("log")
    axes[1].set_title("busiest node / mean, worst")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "load_balance.png", dpi=120)
    plt.close(fig)


def stretch(res: BenchResult, study: RoutingStudy, mc: Sequence[SimRequest], sim: Callable[..., Any]) -> None:
    """kvflow's routing with the adaptive eviction policy on the nodes, against one pooled LRU cache of
    the same total size, on the trace ``mc``: with the policy's defaults
    (``ratios.kv_aware_adaptive_vs_pooled_lru_hit_rate_<cap>``) and with the routed fleet's setting
    (``..._adaptive_routed_...``), each the median over the study's seeds of the router's tiebreak, as
    its routing figures are; ``sim`` runs and records a simulation (:func:`~kvflow.sim.cluster.simulate_seeds`)."""
    for cap in study.capacities:
        pooled = study.row("mooncake", cap, "pooled").hit_rate
        for ev in ("adaptive", "adaptive_routed"):
            r = sim(mc, nodes=study.nodes, capacity=cap, routing="kv_aware_load", eviction=ev,
                    workload="mooncake", decode_s_per_token=DECODE_S_PER_TOKEN, seeds=study.seeds)
            res.ratios[f"kv_aware_{ev}_vs_pooled_lru_hit_rate_{cap}"] = r.hit_rate / pooled if pooled else 1.0
