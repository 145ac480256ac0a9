"""``kvflow sim``: the experiments behind docs/benchmarks.md, with tables, JSON and plots.

Its defaults run exactly these:

1. **Priority eviction on a system-prompt-heavy workload** (one node, 128 blocks of 512 tokens):
   clients pin their system prompts at priority 100; LRU has no hints.
   ``ratios.priority_vs_lru_hit_rate_system_prompt`` (goal ≥ 1.2).
2. **Routing on the Mooncake trace and every generated family** (:mod:`kvflow.sim.routing`): 8
   nodes at 500 / 1,000 / 2,000 blocks each; random, round-robin, least-loaded, KV-aware (cache
   only), Dynamo's cost (at kvflow's overlap weight and at Dynamo's default), the SGLang and llm-d
   anchors and kvflow's router (bounded loads), against one pooled cache of 8 × the capacity; hit
   rate, balance and time to first token. Goals over every trace and capacity:
   ``ratios.kv_aware_vs_pooled_hit_rate_min`` ≥ 0.95,
   ``figures.kv_aware_max_over_mean_load_worst_capacity`` ≤ 1.15, TTFT p99 ≤ round-robin's and
   least-loaded's; at 1,000 blocks on the trace, as before, ``ratios.kv_aware_vs_pooled_hit_rate``.
3. **The stretch**: KV-aware routing with the adaptive eviction policy on 8 nodes, against one
   pooled LRU cache of the same total size.
4. **Hit rate against capacity** of one cache on the Mooncake trace: LRU, priority (the shared
   first block pinned), adaptive, ARC, S3-FIFO (``kvflow.anchors``) and Belady's optimum.
5. **Workload generators** (system-prompt-heavy, multi-turn, agentic, one-shot) × eviction policy.

``load`` (``--load``) runs 2. and 3. at that multiple of every trace's own load (every arrival time
÷ it; :func:`kvflow.sim.request.at_load`): how the defaults, chosen at the traces' load, hold at
another. 4. and 5. replay one cache, where only the order of the requests counts, and do not change.

Outputs: a markdown report and two PNG plots in ``--out`` (default ``artifacts/sim``), and JSON
with ``--json``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvflow.anchors import arc_hit_rate, s3fifo_hit_rate
from kvflow.bench.harness import BenchResult
from kvflow.sim.cluster import ROUTED_ADAPTIVE, SimResult, pooled_belady, simulate_seeds
from kvflow.sim.request import at_load
from kvflow.sim.routing import (
    PREFILL_S_PER_TOKEN,
    SIM_WEIGHTS,
    RoutingStudy,
    plot_load_balance,
    routing_figures,
    routing_report,
    run_routing,
    stretch,
)
from kvflow.sim.workloads import GENERATORS, SimRequest, mooncake
from kvflow.traces import belady_hit_rate


def run_sim(*, trace: str | None = None, nodes: int = 8, capacities: tuple[int, ...] = (500, 1000, 2000),
            reference: int = 1000, curve_capacities: tuple[int, ...] = (500, 1000, 2000, 4000, 8000, 16000),
            system_prompt_capacity: int = 128, generator_requests: int = 6000, limit: int | None = None,
            out_dir: Path = Path("artifacts/sim"), plots: bool = True, load: float = 1.0,
            step: Callable[[str], None] = lambda _m: None) -> BenchResult:
    res = BenchResult("sim")
    rows: list[SimResult] = []

    def sim(reqs: list[SimRequest], seeds: int = 1, **kw: Any) -> SimResult:
        step(f"{kw.get('workload')}: {kw.get('routing')} / {kw.get('eviction')} / {kw.get('nodes')} x "
             f"{kw.get('capacity')}")
        r = simulate_seeds(reqs, seeds=seeds, prefill_s_per_token=PREFILL_S_PER_TOKEN, weights=SIM_WEIGHTS, **kw)
        rows.append(r)
        return r

    # 1. Priority eviction with client configs, system-prompt-heavy.
    sp = GENERATORS["system_prompt"](generator_requests)
    lru = sim(sp, nodes=1, capacity=system_prompt_capacity, routing="pooled", eviction="lru", workload="system_prompt")
    pri = sim(sp, nodes=1, capacity=system_prompt_capacity, routing="pooled", eviction="priority",
              workload="system_prompt")
    res.figures["system_prompt_lru_hit_rate"] = lru.hit_rate
    res.figures["system_prompt_priority_hit_rate"] = pri.hit_rate
    res.ratios["priority_vs_lru_hit_rate_system_prompt"] = pri.hit_rate / lru.hit_rate
    res.goals["priority_vs_lru_hit_rate_system_prompt"] = ">= 1.2"

    # 2./3. Routing on the trace and every family, and the stretch (kvflow.sim.routing).
    mc = mooncake(trace, limit)
    study = run_routing(trace=trace, limit=limit, generator_requests=generator_requests, nodes=nodes,
                        capacities=capacities, load=load, step=step)
    routing_figures(res, study, reference)
    stretch(res, study, at_load(mc, load), sim)
    ref = res.details["routing"]["reference_capacity"]

    # 4. Hit rate against capacity, one cache: the core's policies, ARC, S3-FIFO and Belady.
    curves: dict[str, list[float]] = {"lru": [], "priority": [], "adaptive": [], "arc": [], "s3fifo": [],
                                      "belady": []}
    mc_keys = [r.keys for r in mc]
    for cap in curve_capacities:
        for ev in ("lru", "priority", "adaptive"):
            curves[ev].append(sim(mc, nodes=1, capacity=cap, routing="pooled", eviction=ev,
                                  workload="mooncake").hit_rate)
        step(f"mooncake: arc, s3fifo, belady / 1 x {cap}")
        curves["arc"].append(arc_hit_rate(mc_keys, cap).hit_rate)
        curves["s3fifo"].append(s3fifo_hit_rate(mc_keys, cap).hit_rate)
        b = pooled_belady(mc, nodes=1, capacity=cap, workload="mooncake")
        rows.append(b)
        curves["belady"].append(b.hit_rate)

    # 5. Generators x eviction (the core's policies, then ARC, S3-FIFO and Belady on the same keys).
    gen_table: dict[str, dict[str, float]] = {}
    for name, gen in GENERATORS.items():
        reqs = sp if name == "system_prompt" else gen(generator_requests)
        gen_table[name] = {ev: sim(reqs, nodes=1, capacity=system_prompt_capacity, routing="pooled", eviction=ev,
                                   workload=name).hit_rate for ev in ("lru", "priority", "adaptive")}
        keys = [r.keys for r in reqs]
        gen_table[name]["arc"] = arc_hit_rate(keys, system_prompt_capacity).hit_rate
        gen_table[name]["s3fifo"] = s3fifo_hit_rate(keys, system_prompt_capacity).hit_rate
        gen_table[name]["belady"] = belady_hit_rate(keys, system_prompt_capacity).hit_rate

    res.details.update({
        "nodes": nodes, "capacities": list(capacities), "reference_capacity": ref,
        "weights": {"overlap_weight": SIM_WEIGHTS.overlap_weight, "host_credit": SIM_WEIGHTS.host_credit},
        "prefill_s_per_token": PREFILL_S_PER_TOKEN, "curve_capacities": list(curve_capacities), "curves": curves,
        "generators": gen_table, "runs": [r.as_dict() for r in rows],
    })
    out_dir.mkdir(parents=True, exist_ok=True)
    report = markdown_report(res, study, capacities, curves, curve_capacities, gen_table,
                             system_prompt_capacity)
    (out_dir / "report.md").write_text(report)
    if plots:
        write_plots(out_dir, study, capacities, ref, curves, curve_capacities)
    res.details["report"] = str(out_dir / "report.md")
    return res


def markdown_report(res: BenchResult, study: RoutingStudy, capacities: tuple[int, ...],
                    curves: dict[str, list[float]], curve_capacities: tuple[int, ...],
                    gen_table: dict[str, dict[str, float]], sp_cap: int) -> str:
    lines = ["# kvflow sim", "",
             f"System-prompt-heavy workload, one node of {sp_cap} blocks: LRU "
             f"{res.figures['system_prompt_lru_hit_rate']:.3f}, priority (client configs) "
             f"{res.figures['system_prompt_priority_hit_rate']:.3f} — "
             f"{res.ratios['priority_vs_lru_hit_rate_system_prompt']:.2f}x.", "",
             *routing_report(study)]
    lines += ["", "KV-aware routing with the adaptive policy against one pooled LRU cache of the same size:", ""]
    lines += [f"- {cap:,} blocks per node: {res.ratios[f'kv_aware_adaptive_vs_pooled_lru_hit_rate_{cap}']:.3f}x "
              f"(defaults), {res.ratios[f'kv_aware_adaptive_routed_vs_pooled_lru_hit_rate_{cap}']:.3f}x "
              f"(`frequency_horizons={ROUTED_ADAPTIVE.frequency_horizons:g}`, "
              f"`soon_share={ROUTED_ADAPTIVE.soon_share:g}`, "
              f"`life_tables={ROUTED_ADAPTIVE.life_tables}`)" for cap in capacities]
    lines += ["", "## One cache, Mooncake trace: hit rate against capacity", "",
              "| blocks | " + " | ".join(curves) + " |", "| ---: |" + " ---: |" * len(curves)]
    for i, cap in enumerate(curve_capacities):
        lines.append(f"| {cap:,} | " + " | ".join(f"{curves[k][i]:.4f}" for k in curves) + " |")
    lines += ["", f"## Generated workloads, one node of {sp_cap} blocks", "",
              "| workload | lru | priority | adaptive | arc | s3fifo | belady |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in gen_table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k]:.4f}" for k in
                                                 ("lru", "priority", "adaptive", "arc", "s3fifo", "belady")) + " |")
    return "\n".join(lines) + "\n"


def write_plots(out_dir: Path, study: RoutingStudy, capacities: tuple[int, ...], ref: int,
                curves: dict[str, list[float]], curve_capacities: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, ys in curves.items():
        ax.plot(curve_capacities, ys, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (blocks of 512 tokens)")
    ax.set_ylabel("block hit rate")
    ax.set_title("Mooncake trace, one cache: hit rate against capacity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "hit_rate_vs_capacity.png", dpi=120)
    plt.close(fig)

    plot_load_balance(out_dir, study, ref)


