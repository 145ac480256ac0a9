"""The cluster simulator: the real KV core on N nodes, a router, and time.

**Caches.** Each node runs :class:`~inference_node.kv.manager.KVCacheManager` (no torch) on an
injected clock set to the request's arrival: allocate the prompt — reusing its cached prefix — then
free it. A request's *hit* is the prefix its node holds when it is routed; the blocks it computes are
cached at once (a request that arrives while an earlier one is still being prefilled finds its
blocks: the simulator does not model a prefix that is cached but not computed yet).

**Time.** Each node prefills on one FIFO server (requests wait in arrival order, one is prefilled at
a time): a request's prefill takes its *uncached* prompt tokens × ``prefill_s_per_token``. So:

* ``start = max(arrival, the node's previous prefill's end)``; the wait is ``start − arrival``;
* its time to first token is ``TTFT = wait + uncached tokens × prefill_s_per_token``;
* after its prefill it decodes its output tokens at ``decode_s_per_token`` each (0 by default), in
  parallel with the node's other work (continuous batching): decoding delays no prefill, but the
  request stays *in hand* until its last token.

A node's *load* is what it has in hand when a request arrives: the requests routed to it that have
not finished (being prefilled, waiting, or decoding) and their prompt blocks. That is what a router
counts online (its own in-flight requests); the queue a node reports (its heartbeat's
``queued_requests``, llm-d's queue scorer) is the ones waiting for their prefill, and its KV usage
(vLLM's ``kv_cache_usage_perc``) the blocks of the running ones (prefilling or decoding) over its
capacity. The cache itself does not shrink by the blocks of running requests (they are freed at
once, as before).

Engines batch prefills (chunked prefill) rather than run one at a time; a FIFO server has the same
throughput and order, and keeps the comparison between routers simple and exact.

**Pooled** is the ceiling: one cache of N × the capacity that every request hits, served by N
servers from one FIFO queue (a request starts on the first server free): the best hit rate and the
best queueing a fleet of N could have.

Routing policies (:data:`ROUTING`):

* ``random``, ``round_robin``;
* ``least_loaded``: the fewest prompt blocks in hand (ties: the earliest free, then the index);
* ``kv_aware``: the longest true cached prefix (ties: least loaded) — cache only;
* ``dynamo_cost``: the router's cost (:func:`routing_api.scoring.decide`, Dynamo's
  ``overlap × prefill blocks + load blocks`` with kvflow's credits) with the load bound, the
  tail guard, the bound gate and the queue tiebreak *off*: the router's decisions before bounded loads,
  at the weights given (kvflow's overlap weight, 24: Dynamo's cost as an operator who weighs the
  cache that much would run it);
* ``dynamo_default``: the same at Dynamo's own default, an overlap weight of 1
  (:data:`DYNAMO_OVERLAP_WEIGHT`): a block to prefill weighs as much as a block of load, so it
  balances more and follows the cache less;
* ``kv_aware_load``: kvflow's router, :func:`routing_api.scoring.decide` exactly (bounded loads on),
  with the weights given (default: the router's, which ``kvflow sim`` runs: :data:`kvflow.sim.routing.SIM_WEIGHTS`)
  over the nodes' true prefixes and the loads the router knows, with the prefill work it routed to
  each node kept and laid over the views as the router does, then the bound gate and the queue
  tiebreak (:func:`routing_api.prefill.gate`) and the tail guard (:func:`routing_api.prefill.guard`,
  each on when its weight is) over the prefill queues the router keeps (:class:`RouterPolicy`);
* ``sglang`` and ``llm_d``: the anchors of :mod:`kvflow.sim.router_anchors`, modelled on SGLang's
  cache-aware router and llm-d's scorer (approximate indexes built from the requests they routed).

Eviction policies: ``lru`` (no hints), ``priority`` (the clients' retention configs),
``adaptive`` (learned, defaults), ``adaptive_routed`` (learned, with ``ROUTED_ADAPTIVE``: the
frequency band protected for a few LRU horizons, and new blocks of classes reused soon stored in
it, no recency target: what a routed fleet wants) and ``belady`` (offline optimum; pooled only).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eventbus.protocol import NodeId
from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager, OutOfBlocks
from inference_node.kv.prompt import Prompt
from kvflow.sim import router_anchors as anchors
from kvflow.sim.node import Policy, SimNode
from kvflow.sim.request import BLOCK_TOKENS, SimRequest
from kvflow.traces import belady_hit_rate
from routing_api.hubs import Hubs, after_gate
from routing_api.prefill import PrefillQueue, TtftTail, gate, guard
from routing_api.scoring import (
    DEFAULT_WEIGHTS,
    NodeView,
    PrefixMatch,
    RoutedWork,
    RoutingWeights,
    decide,
    overlay,
    routed_work,
)

#: The prefill rate the router assumes of a node it has not measured yet (the router's default,
#: ``KVFLOW_ROUTER_PREFILL_TOKENS_PER_S``): its queues learn the simulated nodes' own.
ROUTER_PREFILL_TOKENS_PER_S = 10000.0
ROUTING = ("random", "round_robin", "least_loaded", "kv_aware", "dynamo_cost", "dynamo_default", "sglang", "llm_d",
           "kv_aware_load")
#: Dynamo's own default weight of a block to prefill against a block of load (``KvRouterConfig``'s
#: ``overlap_score_weight``, ``--kv-overlap-score-weight``; its temperature is 0 too): ``dynamo_default``.
DYNAMO_OVERLAP_WEIGHT = 1.0
EVICTION = ("lru", "priority", "adaptive", "adaptive_routed")
#: The adaptive policy for nodes behind KV-aware routing (docs/benchmarks.md, "The bands lose in a
#: routed fleet": horizons 2 and soon share 0.3 chosen on the conversation trace's fleet simulation
#: from 2 / 3 / 4 / 6 and 0.3 / 0.5, then checked on five families and a second draw of four; no
#: recency target: with it the same fleet got 1.136 / 1.042 / 0.979 x pooled LRU, without 1.161 /
#: 1.042 / 0.988, "A fifth round").
ROUTED_ADAPTIVE = AdaptivePolicy(frequency_horizons=2.0, soon_share=0.3, life_tables=False)


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by the nearest rank; 0 for no values."""
    if not xs:
        return 0.0
    s = sorted(xs)
    rank = max(1, -(-len(s) * q // 100))  # ceil(n q / 100), at least 1
    return float(s[int(rank) - 1])


@dataclass
class SimResult:
    workload: str
    nodes: int
    capacity_per_node: int
    routing: str
    eviction: str
    hit_blocks: int = 0
    total_blocks: int = 0
    requests_per_node: list[int] = field(default_factory=list)
    prefill_tokens_per_node: list[int] = field(default_factory=list)
    mean_queue_s: float = 0.0
    #: every request's time to first token (wait + its own prefill), in arrival order
    ttft_s: list[float] = field(default_factory=list, repr=False)
    #: prefill tokens of the router's hub copies (:mod:`routing_api.hubs`; in ``prefill_tokens_per_node`` too)
    warmup_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @staticmethod
    def _imbalance(xs: list[int]) -> float:
        mean = sum(xs) / len(xs) if xs else 0.0
        return max(xs) / mean if mean else 1.0

    @property
    def max_over_mean_requests(self) -> float:
        return self._imbalance(self.requests_per_node)

    @property
    def max_over_mean_prefill(self) -> float:
        return self._imbalance(self.prefill_tokens_per_node)

    @property
    def ttft_p50(self) -> float:
        return percentile(self.ttft_s, 50)

    @property
    def ttft_p99(self) -> float:
        return percentile(self.ttft_s, 99)

    def as_dict(self) -> dict[str, object]:
        return {"workload": self.workload, "nodes": self.nodes, "capacity_per_node": self.capacity_per_node,
                "routing": self.routing, "eviction": self.eviction, "hit_rate": round(self.hit_rate, 5),
                "max_over_mean_requests": round(self.max_over_mean_requests, 4),
                "max_over_mean_prefill_tokens": round(self.max_over_mean_prefill, 4),
                "mean_queue_s": round(self.mean_queue_s, 4), "ttft_p50_s": round(self.ttft_p50, 4),
                "ttft_p99_s": round(self.ttft_p99, 4), "warmup_tokens": self.warmup_tokens,
                "requests_per_node": self.requests_per_node, "prefill_tokens_per_node": self.prefill_tokens_per_node}


#: The policies that draw on the random generator (ties among the cheapest nodes broken at random,
#: or every choice): one run of them is one draw of many (the Mooncake trace at 2,000 blocks moved
#: between 0.964 and 1.012 of the best peer's hit rate with the seed alone). :func:`simulate_seeds`
#: runs them at several seeds and reports each figure's median.
SEEDED = ("random", "llm_d", "kv_aware_load")


@dataclass
class SeedMedian(SimResult):
    """A seeded policy's runs at seeds 0, 1, …: each figure (hit rate, balance, TTFT percentiles,
    mean wait) is the median of the runs'; the per-node counts, the block counts and the list of
    TTFTs are the first run's (``runs`` holds every run)."""

    runs: list[SimResult] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, runs: Sequence[SimResult]) -> SeedMedian:
        fields = {f.name: getattr(runs[0], f.name) for f in dataclasses.fields(SimResult)}
        fields["mean_queue_s"] = statistics.median(r.mean_queue_s for r in runs)
        return cls(**fields, runs=list(runs))

    @property
    def hit_rate(self) -> float:
        return statistics.median(r.hit_rate for r in self.runs)

    @property
    def max_over_mean_requests(self) -> float:
        return statistics.median(r.max_over_mean_requests for r in self.runs)

    @property
    def max_over_mean_prefill(self) -> float:
        return statistics.median(r.max_over_mean_prefill for r in self.runs)

    @property
    def ttft_p50(self) -> float:
        return statistics.median(r.ttft_p50 for r in self.runs)

    @property
    def ttft_p99(self) -> float:
        return statistics.median(r.ttft_p99 for r in self.runs)

    def as_dict(self) -> dict[str, object]:
        out = super().as_dict()
        per_node = ("requests_per_node", "prefill_tokens_per_node")
        out["seeds"] = [{k: v for k, v in r.as_dict().items() if k not in per_node} for r in self.runs]
        return out


class _Random:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int:
        return self.rng.randrange(len(nodes))


class _RoundRobin:
    def __init__(self) -> None:
        self.next = 0

    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int:
        k, self.next = self.next % len(nodes), self.next + 1
        return k


def _least_loaded(nodes: Sequence[SimNode]) -> int:
    return min(range(len(nodes)), key=lambda j: (nodes[j].inflight_blocks, nodes[j].busy_until, j))


class _LeastLoaded:
    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int:
        return _least_loaded(nodes)


class _KvAware:
    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int:
        matches = [sum(nd.core.match_prefix(prompt)) for nd in nodes]
        return min(range(len(nodes)), key=lambda j: (-matches[j], nodes[j].inflight_blocks, j))


@dataclass(slots=True)
class InHand:
    """A node's requests in hand and their prompt blocks, as the router counts them (``routing_api.state.Inflight``)."""

    requests: int
    blocks: int


class RouterPolicy:
    """kvflow's router: :func:`routing_api.scoring.decide` over the nodes' true prefixes and their
    loads as the router knows them: its own count of the requests (and their prompt blocks) in hand
    on each node — exact, the router being the only one — and the queue each node reports (its
    heartbeat's ``queued_requests``: the requests waiting for their prefill), without delay; then
    the tail guard (:func:`routing_api.prefill.guard`) over the prefill queues the router keeps,
    which learn each node's rate from the first tokens it sees (:meth:`admitted` tells it when
    each request's comes)."""

    def __init__(self, weights: RoutingWeights, rng: random.Random) -> None:
        self.weights, self.rng = weights, rng
        self.ids: list[NodeId] = []
        #: the prefill work it routed to each node, as the router keeps it (``RouterState.work``)
        self.work: dict[NodeId, RoutedWork] = {}
        #: the prefills it sent each node and has not seen answer (``RouterState.prefill``)
        self.queues: dict[NodeId, PrefillQueue] = {}
        self.tail = TtftTail(weights.ttft_quantile)
        #: (first token, key, node) of the requests sent: the router sees each when its time comes
        self.answers: list[tuple[float, int, NodeId]] = []
        self.sent: tuple[int, NodeId] | None = None
        self.key = 0
        self.hubs = Hubs(weights.hub_fanout)
        #: the hub copies (:mod:`routing_api.hubs`) its last decision sends: (node, blocks of the prompt, key)
        self.warmups: list[tuple[int, int, int]] = []

    def admitted(self, first_token_at: float) -> None:
        """The request just chosen gets its first token at ``first_token_at``."""
        if self.sent is not None:
            heapq.heappush(self.answers, (first_token_at, *self.sent))
            self.sent = None

    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int:
        while self.answers and self.answers[0][0] <= req.t:
            at, key, nid = heapq.heappop(self.answers)
            self.queues[nid].first_token(key, at)
        if len(self.ids) != len(nodes):
            self.ids = [NodeId(str(j)) for j in range(len(nodes))]
        views: list[NodeView] = []
        pm: dict[NodeId, PrefixMatch] = {}
        inflight: dict[NodeId, InHand] = {}
        for nid, nd in zip(self.ids, nodes, strict=True):
            gpu, host = nd.core.match_prefix(prompt)
            pm[nid] = PrefixMatch(gpu, host)
            views.append(NodeView(nid, "", "live", nd.capacity, queued_requests=nd.waiting))
            inflight[nid] = InHand(nd.inflight, nd.inflight_blocks)
        tau = self.weights.work_tau_s
        views = overlay(views, {}, inflight, req.t, work=self.work, tau=tau)  # as the router lays its state over
        decision = decide(len(prompt.digests), views, pm, self.weights, self.rng)
        gate(decision, self.queues, self.weights, ROUTER_PREFILL_TOKENS_PER_S, BLOCK_TOKENS, req.t)
        _stayed, warm = after_gate(self.hubs, decision, prompt.digests, self.queues, req.t)
        guard(decision, self.queues, self.tail, self.weights, ROUTER_PREFILL_TOKENS_PER_S, BLOCK_TOKENS, req.t)
        if warm is not None:
            target = warm.target.node_id
            self.warmups.append((int(target), warm.blocks, self._send(target, warm.work, req.t)))
        chosen = decision.chosen
        assert chosen is not None
        self.sent = (self._send(chosen.node_id, routed_work(chosen), req.t), chosen.node_id)
        return int(chosen.node_id)

    def _send(self, nid: NodeId, work: int, now: float) -> int:
        """Count ``work`` blocks sent to ``nid`` as the router does (its routed work, its prefill queue)."""
        self.work[nid] = self.work.get(nid, RoutedWork()).plus(work, now, self.weights.work_tau_s)
        queue = self.queues.get(nid)
        if queue is None:
            queue = self.queues[nid] = PrefillQueue(BLOCK_TOKENS / ROUTER_PREFILL_TOKENS_PER_S)
        self.key += 1
        queue.add(self.key, work, now)
        return self.key

    def warmed(self, key: int, node: int, first_token_at: float) -> None:
        """The hub copy sent as ``key`` gets its one token at ``first_token_at``."""
        heapq.heappush(self.answers, (first_token_at, key, self.ids[node]))


def make_policy(routing: str, *, nodes: int, capacity: int, weights: RoutingWeights | None,
                rng: random.Random) -> Policy:
    """The policy named ``routing`` (one of :data:`ROUTING`) for ``nodes`` nodes of ``capacity`` blocks."""
    w = weights or DEFAULT_WEIGHTS
    # the cost alone (Dynamo's): no bounds, no tail guard, no bound gate or queue tiebreak
    cost_alone = dataclasses.replace(w, load_bound=0.0, ttft_quantile=0.0, bound_gate=0.0, queue_tiebreak=False)
    policies: dict[str, Callable[[], Policy]] = {
        "random": lambda: _Random(rng),
        "round_robin": _RoundRobin,
        "least_loaded": _LeastLoaded,
        "kv_aware": _KvAware,
        "dynamo_cost": lambda: RouterPolicy(cost_alone, rng),
        "dynamo_default": lambda: RouterPolicy(dataclasses.replace(cost_alone, overlap_weight=DYNAMO_OVERLAP_WEIGHT,
                                                                   temperature=0.0), rng),
        "kv_aware_load": lambda: RouterPolicy(w, rng),
        "sglang": lambda: anchors.SGLangCacheAware(nodes),
        "llm_d": lambda: anchors.LlmdScorer(nodes, capacity, rng),
    }
    if routing not in policies:
        raise ValueError(f"routing must be one of {(*ROUTING, 'pooled')}")
    return policies[routing]()


def _prompt(req: SimRequest) -> Prompt:
    return Prompt.from_block_keys(req.keys, BLOCK_TOKENS)


_ADAPTIVE = {"adaptive": AdaptivePolicy(), "adaptive_routed": ROUTED_ADAPTIVE}


def _core(capacity: int, eviction: str) -> tuple[KVCacheManager, ManualClock]:
    clock = ManualClock()
    core = KVCacheManager(KvCacheConfig(num_gpu_blocks=capacity, block_size=BLOCK_TOKENS, max_queued_events=1 << 30,
                                        adaptive=_ADAPTIVE.get(eviction)), clock=clock)
    return core, clock


def simulate(requests: Sequence[SimRequest], *, nodes: int, capacity: int, routing: str, eviction: str,
             workload: str = "", prefill_s_per_token: float = 2e-5, decode_s_per_token: float = 0.0,
             weights: RoutingWeights | None = None, seed: int = 0, policy: Policy | None = None,
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Run a workload on ``nodes`` caches of ``capacity`` blocks each (``pooled``: one of N×, N servers).

    ``weights`` are the router's for ``kv_aware_load``, ``dynamo_cost`` and ``dynamo_default`` (default:
    the router's defaults; ``dynamo_default`` at Dynamo's overlap weight); ``policy`` replaces the named
    one (experiments)."""
    if eviction not in EVICTION:
        raise ValueError(f"eviction must be one of {(*EVICTION, 'belady')} (belady: see pooled_belady)")
    pooled = routing == "pooled"
    rng = random.Random(seed)
    if not pooled and policy is None:
        policy = make_policy(routing, nodes=nodes, capacity=capacity, weights=weights, rng=rng)
    cap = capacity * nodes if pooled else capacity
    ns = [SimNode(*_core(cap, eviction), capacity=cap) for _ in range(1 if pooled else nodes)]
    servers = [(0.0, j) for j in range(nodes)]  # pooled: (free at, server) of its N servers
    per_server = [[0, 0] for _ in range(nodes)]  # pooled: requests, prefill tokens
    res = SimResult(workload, nodes, capacity, routing, eviction)
    #: a policy may want to know when each request it chose gets its first token (the router's view)
    admitted = getattr(policy, "admitted", None)
    queue_total = 0.0
    for i, req in enumerate(requests):
        prompt = _prompt(req)
        blocks = len(prompt.digests)
        for nd in ns:
            nd.settle(req.t)
        k = 0 if pooled or policy is None else policy.choose(req, prompt, ns)
        warmups = getattr(policy, "warmups", None)
        while warmups:  # the hub copies the router sends with this decision
            j, n, key = warmups.pop()
            policy.warmed(key, j, _warm(ns[j], req, n, prefill_s_per_token, res))  # type: ignore[union-attr]
        nd = ns[k]
        nd.clock.set(max(nd.clock.now, req.t))
        hit = 0
        if blocks <= cap:
            try:
                alloc = nd.core.allocate("r", prompt, req.retention if eviction == "priority" else None)
                hit = alloc.num_cached_tokens // BLOCK_TOKENS
                nd.core.free("r")
            except OutOfBlocks:  # cannot happen: every request is freed at once
                pass
        if i % 512 == 0:
            nd.core.drain_events()
            if progress:
                progress(i)
        res.hit_blocks += hit
        res.total_blocks += blocks
        uncached = (blocks - hit) * BLOCK_TOKENS
        prefill = uncached * prefill_s_per_token
        if pooled:
            free_at, j = heapq.heappop(servers)
            start = max(req.t, free_at)
            heapq.heappush(servers, (start + prefill, j))
            per_server[j][0] += 1
            per_server[j][1] += uncached
        else:
            start = nd.admit(req.t, blocks, prefill, req.output_tokens * decode_s_per_token)
            if admitted is not None:
                admitted(start + prefill)
            nd.requests += 1
            nd.prefill_tokens += uncached
        queue_total += start - req.t
        res.ttft_s.append(start - req.t + prefill)
    if pooled:
        res.requests_per_node = [s[0] for s in per_server]
        res.prefill_tokens_per_node = [s[1] for s in per_server]
    else:
        res.requests_per_node = [nd.requests for nd in ns]
        res.prefill_tokens_per_node = [nd.prefill_tokens for nd in ns]
    res.mean_queue_s = queue_total / max(1, len(requests))
    return res


def _warm(nd: SimNode, req: SimRequest, blocks: int, prefill_s_per_token: float, res: SimResult) -> float:
    """A hub copy on ``nd``: the first ``blocks`` of ``req``'s prompt prefilled there (the blocks it
    lacks, in its prefill queue and its prefill tokens), one token, no decode. Returns when its token comes."""
    nd.clock.set(max(nd.clock.now, req.t))
    alloc = nd.core.allocate("w", _prompt(dataclasses.replace(req, keys=req.keys[:blocks])), None)
    nd.core.free("w")
    uncached = (blocks - alloc.num_cached_tokens // BLOCK_TOKENS) * BLOCK_TOKENS
    prefill = uncached * prefill_s_per_token
    nd.prefill_tokens += uncached
    res.warmup_tokens += uncached
    return nd.admit(req.t, blocks, prefill, 0.0) + prefill


def simulate_seeds(requests: Sequence[SimRequest], *, seeds: int, routing: str, **kw: Any) -> SimResult:
    """:func:`simulate` at seeds 0 … ``seeds`` − 1, each figure the median (:class:`SeedMedian`), for a
    policy of :data:`SEEDED`; one run for any other (it draws nothing at random)."""
    if seeds <= 1 or routing not in SEEDED:
        return simulate(requests, routing=routing, **kw)
    return SeedMedian.of([simulate(requests, routing=routing, seed=s, **kw) for s in range(seeds)])


def pooled_belady(requests: Sequence[SimRequest], *, nodes: int, capacity: int, workload: str = "") -> SimResult:
    r = belady_hit_rate([req.keys for req in requests], capacity * nodes)
    res = SimResult(workload, nodes, capacity, "pooled", "belady", r.hit_blocks, r.total_blocks)
    return res
