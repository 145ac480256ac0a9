"""``kvflow bench kv``: the KV core's speed against an OrderedDict LRU, and its hit rates.

Part 1, cost per operation. One stream of requests (shared system prompts, growing
conversations, one-off prompts) runs through a 100k-block pool twice, interleaved: through the
priority core (allocate = prefix lookup + reference counts + allocation + evictions, then free;
events queued and drained as a publisher would) and through :class:`LruBlockManager`, a plain
LRU block manager on an ``OrderedDict`` doing the same block work without priorities, tiers or
events. Digests are computed before timing for both. ``ratios.cost_vs_lru`` = core seconds /
baseline seconds (goal ≤ 2).

Part 2, hit rates. The Mooncake conversation trace (or ``--trace FILE``) and seven generated
families (``FAMILIES``, docs/traces.md) replayed on one cache of 1,000 / 4,000 / 16,000 blocks of
512 tokens: LRU (the core without hints), the adaptive policy, ARC and S3-FIFO
(``kvflow.anchors``, from their papers, with prefix semantics) and Belady's offline optimum. The
main trace's figures keep their plain names, a family's are prefixed with its name; the minima
over all (``ratios.adaptive_vs_lru_hit_rate_min``, ``..._vs_arc_...``, goals ≥ 1) and ≥ 1.4× LRU at
4,000 blocks on the trace (issue 18). A PNG of hit rate against capacity per workload goes to
``plot_dir``.

Part 2b, the same on more traffic (``robustness``): each family's second draw (seed + 100) and
the trace cut in thirds, each replayed from a cold cache (LRU, adaptive, ARC); their minima are
reported (``ratios.robustness_adaptive_vs_{lru,arc}_hit_rate_min``) without a goal.

Part 3, the adaptive policy's cost: the main trace replayed at 4,000 blocks with the adaptive
policy and with plain priority eviction (each request's first block pinned by a client config),
interleaved: ``ratios.adaptive_cost_vs_priority`` (goal ≤ 1.5), with the policy as installed (its
ghosts, shadows and life tables compiled when ``kvflow_native`` is: ``details.adaptive_tables``). With the
extension installed the same replay with the Python tables runs in the same rounds, reported
without a goal: ``ratios.adaptive_python_cost_vs_priority``.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from eventbus.hashing import DEFAULT_BLOCK_SIZE, chain_digests
from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.kv.prompt import Prompt
from inference_node.kv.shadows import native_available
from kvflow.anchors import arc_hit_rate, s3fifo_hit_rate
from kvflow.bench.harness import BenchResult, interleaved
from kvflow.traces import (
    TraceRequest,
    belady_hit_rate,
    default_trace_path,
    hash_id_lists,
    load_trace,
    replay_core,
    trace_prompts,
)

BLOCK_SIZE = DEFAULT_BLOCK_SIZE
#: The generated families replayed beside the trace (all of kvflow.sim.workloads but one_shot,
#: which has nothing to reuse: every policy's hit rate is 0 there).
FAMILIES = ("system_prompt", "multi_turn", "agentic", "rag", "scan", "shifting_mix", "hot_prefixes",
            "bursts", "zipf_skew", "long_tail", "many_tenants", "prefix_tree")


def synthetic_stream(n_requests: int, seed: int = 7) -> list[Prompt]:
    """Requests with realistic sharing: 40 system prompts, multi-turn sessions, one-off prompts."""
    rng = random.Random(seed)
    next_key = 1

    def fresh(n: int) -> list[int]:
        nonlocal next_key
        keys = list(range(next_key, next_key + n))
        next_key += n
        return keys

    systems = [fresh(rng.randint(4, 32)) for _ in range(40)]
    sessions: list[list[int]] = []
    prompts: list[Prompt] = []
    for _ in range(n_requests):
        r = rng.random()
        if r < 0.45 and sessions:  # next turn of a conversation: its whole history plus a bit
            i = rng.randrange(len(sessions))
            keys = sessions[i] + fresh(rng.randint(1, 6))
            sessions[i] = keys if len(keys) < 96 else rng.choice(systems) + fresh(2)
        elif r < 0.8:  # a new conversation under a system prompt
            keys = rng.choice(systems) + fresh(rng.randint(2, 16))
            sessions.append(keys)
            if len(sessions) > 2000:
                sessions.pop(rng.randrange(len(sessions)))
        else:  # a one-off prompt
            keys = fresh(rng.randint(1, 24))
        prompts.append(Prompt.from_block_keys(keys, BLOCK_SIZE))
    return prompts


def run_core(prompts: Sequence[Prompt], num_blocks: int) -> KVCacheManager:
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=num_blocks, block_size=BLOCK_SIZE,
                                       max_queued_events=1 << 20))
    allocate, free, drain = mgr.allocate, mgr.free, mgr.drain_events
    for i, p in enumerate(prompts):
        allocate("r", p)
        free("r")
        if i & 63 == 0:
            drain()
    drain()
    return mgr


class LruBlockManager:
    """The baseline: a plain LRU block manager on an ``OrderedDict`` (vLLM's design, minus events).

    It does the same job as the core for this benchmark (prefix lookup, reference counts, slot
    allocation, LRU eviction of unused blocks, release) with none of the priority machinery:
    no priorities or durations, no leaf rule, no host tier, no events.
    """

    def __init__(self, num_blocks: int) -> None:
        self.free_slots = list(range(num_blocks))
        self.cached: dict[bytes, list[int]] = {}  # digest -> [slot, ref]
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # unused cached blocks, oldest first
        self.requests: dict[str, list[bytes]] = {}

    def allocate(self, rid: str, prompt: Prompt) -> int:
        cached, lru = self.cached, self.lru
        held: list[bytes] = []
        hits = 0
        for d in prompt.digests:
            e = cached.get(d)
            if e is None:
                break
            if e[1] == 0:
                del lru[d]
            e[1] += 1
            held.append(d)
            hits += 1
        for d in prompt.digests[hits:]:
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim, _ = lru.popitem(last=False)
                slot = cached.pop(victim)[0]
            cached[d] = [slot, 1]
            held.append(d)
        self.requests[rid] = held
        return hits

    def free(self, rid: str) -> None:
        cached, lru = self.cached, self.lru
        for d in reversed(self.requests.pop(rid)):
            e = cached[d]
            e[1] -= 1
            if e[1] == 0:
                lru[d] = None


def run_lru(prompts: Sequence[Prompt], num_blocks: int) -> LruBlockManager:
    mgr = LruBlockManager(num_blocks)
    allocate, free = mgr.allocate, mgr.free
    for p in prompts:
        allocate("r", p)
        free("r")
    return mgr


def run_lookups_core(mgr: KVCacheManager, prompts: Sequence[Prompt]) -> int:
    match = mgr.match_prefix
    return sum(sum(match(p)) for p in prompts)


def run_lookups_lru(mgr: LruBlockManager, prompts: Sequence[Prompt]) -> int:
    cached = mgr.cached
    hits = 0
    for p in prompts:
        for d in p.digests:
            if d not in cached:
                break
            hits += 1
    return hits


def bench_kv(*, num_blocks: int = 100_000, requests: int = 30_000, repeats: int = 5,
             capacities: Sequence[int] = (1000, 4000, 16000), trace_limit: int | None = None,
             trace_path: str | None = None, families: Sequence[str] = FAMILIES, family_requests: int = 6000,
             plot_dir: Path | None = None, robustness: bool = True, floor_requests: int = 8000,
             say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """See the module docstring; ``trace_path``: a trace in the Mooncake format (default: the
    conversation trace, ``kvflow.traces.default_trace_path``); ``families``: generated workloads
    (``kvflow.sim.workloads.GENERATORS``) replayed beside it; ``plot_dir``: where the PNG goes;
    ``robustness``: also the second draw of each family and the trace in thirds (Part 2b);
    ``floor_requests``: the length of the adversarial traces the floor is checked on."""
    res = BenchResult("kv")
    say(f"building a stream of {requests:,} requests …")
    prompts = synthetic_stream(requests)
    block_ops = sum(len(p.digests) for p in prompts)

    say(f"cost per operation on a pool of {num_blocks:,} blocks ({repeats} interleaved rounds) …")
    def churn_core() -> None:
        run_core(prompts, num_blocks)

    def churn_lru() -> None:
        run_lru(prompts, num_blocks)

    runs = interleaved({"core": churn_core, "lru": churn_lru}, warmup=1, repeats=repeats)
    mgr = run_core(prompts, num_blocks)
    lru = run_lru(prompts, num_blocks)

    def lookup_core() -> None:
        run_lookups_core(mgr, prompts)

    def lookup_lru() -> None:
        run_lookups_lru(lru, prompts)

    lookups = interleaved({"core": lookup_core, "lru": lookup_lru}, warmup=1, repeats=repeats)

    tokens = list(range(BLOCK_SIZE * 4096))
    t0 = time.perf_counter()
    for _ in range(5):
        chain_digests(tokens, BLOCK_SIZE)
    hash_s = (time.perf_counter() - t0) / (5 * 4096)

    core_s, lru_s = runs["core"].median, runs["lru"].median
    res.figures.update({
        "block_ops_per_s": block_ops / core_s,
        "requests_per_s": len(prompts) / core_s,
        "ns_per_block_op": core_s / block_ops * 1e9,
        "lookup_blocks_per_s": block_ops / lookups["core"].median,
        "hash_ns_per_block": hash_s * 1e9,
        "evictions": float(sum(mgr.stats.evictions_by_priority.values())),
    })
    res.baseline.update({
        "lru_block_ops_per_s": block_ops / lru_s,
        "lru_ns_per_block_op": lru_s / block_ops * 1e9,
        "lru_lookup_blocks_per_s": block_ops / lookups["lru"].median,
    })
    res.ratios.update({
        "cost_vs_lru": core_s / lru_s,
        "lookup_cost_vs_lru": lookups["core"].median / lookups["lru"].median,
        "hash_vs_block_op": hash_s / (core_s / block_ops),
    })
    res.goals["cost_vs_lru"] = "<= 2"
    res.details.update({
        "pool_blocks": num_blocks, "requests": len(prompts), "block_ops": block_ops,
        "block_size": BLOCK_SIZE, "core_seconds": runs["core"].as_dict(), "lru_seconds": runs["lru"].as_dict(),
        "hit_rate_core": mgr.stats.hit_blocks / block_ops,
        "hit_rate_lru_baseline_note": "same stream; the core's leaf-only LRU and the OrderedDict differ slightly",
    })

    traces = {"trace": load_trace(trace_path, limit=trace_limit)}
    if families:
        from kvflow.sim.workloads import GENERATORS, as_trace

        for name in families:
            traces[name] = as_trace(GENERATORS[name](family_requests))
    curves: dict[str, dict[str, list[float]]] = {}
    lru_min = arc_min = float("inf")
    for name, trace in traces.items():
        say(f"replaying {name} ({len(trace):,} requests): LRU, adaptive, ARC, S3-FIFO, Belady …")
        curves[name] = hit_rates(trace, capacities)
        lo, ao = _ratios_into(res, name, curves[name], capacities)
        lru_min, arc_min = min(lru_min, lo), min(arc_min, ao)
    res.ratios["adaptive_vs_lru_hit_rate_min"] = lru_min
    res.ratios["adaptive_vs_arc_hit_rate_min"] = arc_min
    res.goals["adaptive_vs_lru_hit_rate_min"] = ">= 1"
    res.goals["adaptive_vs_arc_hit_rate_min"] = ">= 1"
    # issue 41: at least ARC wherever ARC gains more than 5 % over LRU (its other goal, >= 0.99 x
    # LRU everywhere, is met when the minimum above is)
    gains = [_ratio(c["adaptive"][i], c["arc"][i]) for c in curves.values() for i in range(len(capacities))
             if _ratio(c["arc"][i], c["lru"][i]) > ARC_GAINS]
    res.ratios["adaptive_vs_arc_where_arc_gains_min"] = min(gains, default=1.0)
    res.goals["adaptive_vs_arc_where_arc_gains_min"] = ">= 1"
    if robustness:
        say("the same on more traffic: each family's second draw and the trace in thirds (LRU, adaptive, ARC) …")
        _robustness_into(res, traces["trace"], families, family_requests, capacities)
    if 4000 in capacities:
        res.goals["adaptive_vs_lru_hit_rate_4000"] = ">= 1.4"

    say("the floor on traces built to defeat the policy (kvflow/sim/adversarial.py) …")
    _floor_into(res, floor_requests)
    say("cost per request of the trace replay: adaptive vs plain priority eviction (interleaved) …")
    main = traces["trace"]
    _adaptive_cost(res, main, 4000 if 4000 in capacities else capacities[0], repeats)
    res.details["curves"] = curves
    if plot_dir is not None:
        res.details["plot"] = str(plot_curves(curves, capacities, plot_dir))
    res.details["trace_requests"] = len(main)
    res.details["trace"] = str(trace_path or default_trace_path())
    return res


POLICIES = ("lru", "adaptive", "arc", "s3fifo", "belady")
#: Where ARC gains more than this over LRU, the adaptive policy should keep at least ARC's hits.
ARC_GAINS = 1.05
#: The second draw of a family: its default seed plus this (a set the goals' cells do not include).
SECOND_DRAW = 100


def robustness_sets(trace: Sequence[TraceRequest], families: Sequence[str],
                    family_requests: int) -> dict[str, list[TraceRequest]]:
    """More traffic than the goals' cells: each family's second draw (seed + ``SECOND_DRAW``) and
    the trace cut in thirds (each replayed from a cold cache, as a shorter trace would be)."""
    import inspect

    from kvflow.sim.workloads import GENERATORS, as_trace

    out: dict[str, list[TraceRequest]] = {}
    for name in families:
        gen = GENERATORS[name]
        seed = inspect.signature(gen).parameters["seed"].default + SECOND_DRAW
        out[f"{name}_second_draw"] = as_trace(gen(family_requests, seed=seed))
    third = -(-len(trace) // 3)
    for i in range(3):
        part = list(trace[i * third:(i + 1) * third])
        if part:
            out[f"trace_third_{i + 1}"] = part
    return out


def _robustness_into(res: BenchResult, trace: Sequence[TraceRequest], families: Sequence[str],
                     family_requests: int, capacities: Sequence[int]) -> None:
    """Part 2b: adaptive / LRU and adaptive / ARC on :func:`robustness_sets`, their minima as
    ``ratios.robustness_adaptive_vs_{lru,arc}_hit_rate_min`` (reported, no goal) and every cell
    in ``details.robustness``."""
    cells: dict[str, dict[str, list[float]]] = {}
    lru_min = arc_min = float("inf")
    for name, t in robustness_sets(trace, families, family_requests).items():
        prompts, ids = trace_prompts(t), hash_id_lists(t)
        row: dict[str, list[float]] = {"lru": [], "adaptive": [], "arc": []}
        for cap in capacities:
            lru = replay_core(t, prompts, cap).hit_rate
            ad = replay_core(t, prompts, cap, adaptive=AdaptivePolicy()).hit_rate
            arc = arc_hit_rate(ids, cap).hit_rate
            row["lru"].append(lru)
            row["adaptive"].append(ad)
            row["arc"].append(arc)
            lru_min, arc_min = min(lru_min, _ratio(ad, lru)), min(arc_min, _ratio(ad, arc))
        cells[name] = row
    res.ratios["robustness_adaptive_vs_lru_hit_rate_min"] = lru_min
    res.ratios["robustness_adaptive_vs_arc_hit_rate_min"] = arc_min
    res.details["robustness"] = cells


def _floor_into(res: BenchResult, n: int) -> None:
    """The floor's cells (``kvflow.sim.adversarial.floor_report``, ``n`` requests per trap) in
    ``details.floor``; the worst excess over the argued bound as ``ratios.floor_bound_excess_max``
    (goal: at most 0); the least of its hits against LRU's there as ``floor_vs_lru_min_adversarial``."""
    from kvflow.sim.adversarial import floor_report

    small = n < 8000  # --quick: smaller caches and windows, so that the traps still turn around
    cells = floor_report(n=n, capacities=(100, 250) if small else (200, 1000), window=250 if small else 1000)
    res.details["floor"] = cells
    res.ratios["floor_bound_excess_max"] = max(c["bound_excess"] for c in cells.values())
    res.goals["floor_bound_excess_max"] = "<= 0"
    res.ratios["floor_vs_lru_min_adversarial"] = min(c["floor_vs_lru"] for c in cells.values())


def _adaptive_cost(res: BenchResult, main: Sequence[TraceRequest], cap: int, repeats: int) -> None:
    """``ratios.adaptive_cost_vs_priority``: the trace replayed at ``cap`` blocks with the adaptive
    policy and with plain priority eviction (each request's first block pinned), interleaved: a
    warm-up round (with more than one round), then ``repeats`` rounds; each round's ratio goes to
    ``details.cost_round_ratios`` (on these machines the rounds of one run spread by ±15 %).
    The policy runs as installed: its ghosts, shadows and life tables in ``kvflow_native`` when
    that is there (``details.adaptive_tables`` says which), and then the Python tables in the same
    rounds too (``ratios.adaptive_python_cost_vs_priority``: the cost without the extension), and
    without the floor and without the life tables' guard (``ratios.adaptive_floor_cost``,
    ``ratios.adaptive_strict_guard_cost``: what each costs, the policy over the policy without it).

    NOTE: two rounds without a warm-up until 2026-12-04 (too few to tell the policy from the noise)."""
    prompts = trace_prompts(main)
    compiled = native_available()

    def replay_priority() -> None:
        replay_core(main, prompts, cap, pin_first=True)

    def replay_adaptive() -> None:
        replay_core(main, prompts, cap, adaptive=AdaptivePolicy())

    def replay_python() -> None:
        replay_core(main, prompts, cap, adaptive=AdaptivePolicy(compiled=False))

    def replay_no_floor() -> None:
        replay_core(main, prompts, cap, adaptive=AdaptivePolicy(floor=False))

    def replay_no_strict_guard() -> None:
        replay_core(main, prompts, cap, adaptive=AdaptivePolicy(strict_guard=False))

    subjects: dict[str, Callable[[], float | None]] = {"priority": replay_priority, "adaptive": replay_adaptive,
                                                       "no_floor": replay_no_floor,
                                                       "no_strict_guard": replay_no_strict_guard}
    if compiled:
        subjects["python"] = replay_python
    cost = interleaved(subjects, warmup=1 if repeats > 1 else 0, repeats=repeats)
    res.figures["adaptive_us_per_request"] = cost["adaptive"].median / len(main) * 1e6
    res.baseline["priority_us_per_request"] = cost["priority"].median / len(main) * 1e6
    res.ratios["adaptive_cost_vs_priority"] = cost["adaptive"].median / cost["priority"].median
    res.goals["adaptive_cost_vs_priority"] = "<= 1.5"
    res.details["adaptive_tables"] = "compiled" if compiled else "python"
    res.ratios["adaptive_floor_cost"] = cost["adaptive"].median / cost["no_floor"].median
    res.ratios["adaptive_strict_guard_cost"] = cost["adaptive"].median / cost["no_strict_guard"].median
    if compiled:
        res.figures["adaptive_python_us_per_request"] = cost["python"].median / len(main) * 1e6
        res.ratios["adaptive_python_cost_vs_priority"] = cost["python"].median / cost["priority"].median
    res.details["cost_capacity"] = cap
    res.details["cost_round_ratios"] = [a / p for a, p in zip(cost["adaptive"].values, cost["priority"].values,
                                                              strict=True)]


def hit_rates(trace: Sequence[TraceRequest], capacities: Sequence[int]) -> dict[str, list[float]]:
    """Each policy's hit rate on one cache of each capacity (the core for LRU and adaptive)."""
    prompts = trace_prompts(trace)
    ids = hash_id_lists(trace)
    out: dict[str, list[float]] = {p: [] for p in POLICIES}
    for cap in capacities:
        out["lru"].append(replay_core(trace, prompts, cap).hit_rate)
        out["adaptive"].append(replay_core(trace, prompts, cap, adaptive=AdaptivePolicy()).hit_rate)
        out["arc"].append(arc_hit_rate(ids, cap).hit_rate)
        out["s3fifo"].append(s3fifo_hit_rate(ids, cap).hit_rate)
        out["belady"].append(belady_hit_rate(ids, cap).hit_rate)
    return out


def _ratio(a: float, b: float) -> float:
    """a / b, where two zero hit rates (nothing to reuse) tie."""
    if b:
        return a / b
    return 1.0 if not a else float("inf")


def _ratios_into(res: BenchResult, name: str, c: dict[str, list[float]],
                 capacities: Sequence[int]) -> tuple[float, float]:
    """Put one trace's figures into ``res`` (the main trace under the unprefixed names of earlier
    releases); returns its minimum adaptive/LRU and adaptive/ARC ratios."""
    pre = "" if name == "trace" else f"{name}_"
    lru_min = arc_min = float("inf")
    for i, cap in enumerate(capacities):
        lru, ad, arc, s3, bel = (c[p][i] for p in POLICIES)
        res.figures[f"{pre}adaptive_hit_rate_{cap}"] = ad
        for p, v in (("lru", lru), ("arc", arc), ("s3fifo", s3), ("belady", bel)):
            res.baseline[f"{pre}{p}_hit_rate_{cap}"] = v
        vs_lru, vs_arc = _ratio(ad, lru), _ratio(ad, arc)
        res.ratios[f"{pre}adaptive_vs_lru_hit_rate_{cap}"] = vs_lru
        res.ratios[f"{pre}adaptive_vs_arc_hit_rate_{cap}"] = vs_arc
        res.ratios[f"{pre}adaptive_vs_s3fifo_hit_rate_{cap}"] = _ratio(ad, s3)
        res.ratios[f"{pre}arc_vs_lru_hit_rate_{cap}"] = _ratio(arc, lru)
        res.ratios[f"{pre}s3fifo_vs_lru_hit_rate_{cap}"] = _ratio(s3, lru)
        res.ratios[f"{pre}adaptive_vs_belady_hit_rate_{cap}"] = ad / bel if bel else 0.0
        lru_min, arc_min = min(lru_min, vs_lru), min(arc_min, vs_arc)
    return lru_min, arc_min


def plot_curves(curves: dict[str, dict[str, list[float]]], capacities: Sequence[int], out_dir: Path) -> Path:
    """Hit rate against capacity for every policy, one panel per trace (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(curves)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, c) in zip(axes.flat, curves.items(), strict=False):
        for policy, ys in c.items():
            ax.plot(capacities, ys, marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("blocks of 512 tokens")
        ax.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "kv_hit_rate_vs_capacity.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
