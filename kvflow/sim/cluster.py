"""The cluster simulator: the real KV core on N nodes, a router, and a queueing model of load.

Each node runs :class:`~inference_node.kv.manager.KVCacheManager` (no torch) at the request's
arrival time (an injected clock): allocate the prompt — reusing its cached prefix — then free it.
A node serves requests one after another; a request's service time is its uncached prompt tokens
times ``prefill_s_per_token`` plus its output tokens times ``decode_s_per_token``, so routing many
requests to one node makes it busy, and "load" means what it has in hand when a request arrives:
requests and their blocks not finished yet.

Routing policies:

* ``random``, ``round_robin``;
* ``least_loaded``: the fewest blocks in hand;
* ``kv_aware``: the longest cached prefix (ties: least loaded) — cache only;
* ``kv_aware_load``: the router's own scoring (:func:`routing_api.scoring.decide`, Dynamo's cost
  with kvflow's credits) over the nodes' true prefixes and loads.

``pooled`` is the ceiling: one cache of N × the capacity that every request hits.
Eviction policies: ``lru`` (no hints), ``priority`` (the clients' retention configs),
``adaptive`` (learned), and ``belady`` (offline optimum; pooled only).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from eventbus.protocol import NodeId
from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager, OutOfBlocks
from inference_node.kv.prompt import Prompt
from kvflow.sim.workloads import BLOCK_TOKENS, SimRequest
from kvflow.traces import belady_hit_rate
from routing_api.scoring import NodeView, PrefixMatch, RoutingWeights, decide

ROUTING = ("random", "round_robin", "least_loaded", "kv_aware", "kv_aware_load")
EVICTION = ("lru", "priority", "adaptive")


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

    def as_dict(self) -> dict[str, object]:
        return {"workload": self.workload, "nodes": self.nodes, "capacity_per_node": self.capacity_per_node,
                "routing": self.routing, "eviction": self.eviction, "hit_rate": round(self.hit_rate, 5),
                "max_over_mean_requests": round(self.max_over_mean_requests, 4),
                "max_over_mean_prefill_tokens": round(self.max_over_mean_prefill, 4),
                "mean_queue_s": round(self.mean_queue_s, 3),
                "requests_per_node": self.requests_per_node, "prefill_tokens_per_node": self.prefill_tokens_per_node}


@dataclass
class _Node:
    core: KVCacheManager
    clock: ManualClock
    busy_until: float = 0.0
    inflight: list[tuple[float, int]] = field(default_factory=list)  # (finish time, blocks) heap
    inflight_blocks: int = 0
    requests: int = 0
    prefill_tokens: int = 0

    def settle(self, now: float) -> None:
        while self.inflight and self.inflight[0][0] <= now:
            _, blocks = heapq.heappop(self.inflight)
            self.inflight_blocks -= blocks


def _prompt(req: SimRequest) -> Prompt:
    return Prompt.from_block_keys(req.keys, BLOCK_TOKENS)


def simulate(requests: Sequence[SimRequest], *, nodes: int, capacity: int, routing: str, eviction: str,
             workload: str = "", prefill_s_per_token: float = 2e-5, decode_s_per_token: float = 0.0,
             weights: RoutingWeights | None = None, seed: int = 0,
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Run a workload on ``nodes`` caches of ``capacity`` blocks each (``pooled``: one of N×)."""
    if eviction not in EVICTION:
        raise ValueError(f"eviction must be one of {EVICTION} (belady: see pooled_belady)")
    pooled = routing == "pooled"
    n = 1 if pooled else nodes
    cap = capacity * nodes if pooled else capacity
    ns = []
    for _ in range(n):
        clock = ManualClock()
        core = KVCacheManager(KvCacheConfig(num_gpu_blocks=cap, block_size=BLOCK_TOKENS, max_queued_events=1 << 30,
                                            adaptive=AdaptivePolicy() if eviction == "adaptive" else None),
                              clock=clock)
        ns.append(_Node(core, clock))
    w = weights or RoutingWeights()
    rng = random.Random(seed)
    res = SimResult(workload, nodes, capacity, routing, eviction)
    rr = 0
    queue_total = 0.0
    for i, req in enumerate(requests):
        prompt = _prompt(req)
        blocks = len(prompt.digests)
        for nd in ns:
            nd.settle(req.t)
        if pooled or n == 1:
            k = 0
        elif routing == "random":
            k = rng.randrange(n)
        elif routing == "round_robin":
            k, rr = rr % n, rr + 1
        elif routing == "least_loaded":
            k = min(range(n), key=lambda j: (ns[j].inflight_blocks, ns[j].busy_until, j))
        elif routing == "kv_aware":
            matches = [sum(ns[j].core.match_prefix(prompt)) for j in range(n)]
            k = min(range(n), key=lambda j: (-matches[j], ns[j].inflight_blocks, j))
        elif routing == "kv_aware_load":
            views: list[NodeView] = []
            pm: dict[NodeId, PrefixMatch] = {}
            for j, nd in enumerate(ns):
                gpu, host = nd.core.match_prefix(prompt)
                pm[NodeId(str(j))] = PrefixMatch(gpu, host)
                views.append(NodeView(NodeId(str(j)), "", "live", cap, active_blocks=nd.inflight_blocks,
                                      active_requests=len(nd.inflight)))
            chosen = decide(blocks, views, pm, w, rng).chosen
            assert chosen is not None
            k = int(chosen.node_id)
        else:
            raise ValueError(f"routing must be one of {(*ROUTING, 'pooled')}")
        nd = ns[k]
        nd.clock.set(max(nd.clock.now, req.t))
        retention = req.retention if eviction == "priority" else None
        if blocks > cap:
            res.total_blocks += blocks
            continue
        try:
            alloc = nd.core.allocate("r", prompt, retention)
        except OutOfBlocks:  # cannot happen: every request is freed at once
            res.total_blocks += blocks
            continue
        hit = alloc.num_cached_tokens // BLOCK_TOKENS
        nd.core.free("r")
        if i % 512 == 0:
            nd.core.drain_events()
            if progress:
                progress(i)
        res.hit_blocks += hit
        res.total_blocks += blocks
        uncached = (blocks - hit) * BLOCK_TOKENS
        start = max(req.t, nd.busy_until)
        queue_total += start - req.t
        nd.busy_until = start + uncached * prefill_s_per_token + req.output_tokens * decode_s_per_token
        heapq.heappush(nd.inflight, (nd.busy_until, blocks))
        nd.inflight_blocks += blocks
        nd.requests += 1
        nd.prefill_tokens += uncached
    res.requests_per_node = [nd.requests for nd in ns]
    res.prefill_tokens_per_node = [nd.prefill_tokens for nd in ns]
    res.mean_queue_s = queue_total / max(1, len(requests))
    return res


def pooled_belady(requests: Sequence[SimRequest], *, nodes: int, capacity: int, workload: str = "") -> SimResult:
    r = belady_hit_rate([req.keys for req in requests], capacity * nodes)
    res = SimResult(workload, nodes, capacity, "pooled", "belady", r.hit_blocks, r.total_blocks)
    return res
