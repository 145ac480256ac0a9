"""KV-aware node selection: a pure function of the prompt's blocks, the nodes, and what they hold.

Dynamo's cost, extended (docs/architecture.md#routing-cost)::

    cost = overlap_weight × prefill_blocks + decode_blocks

Both terms are in blocks of the decision's block size (the *unit*: the fleet's block size). A
fleet may mix block sizes (bridged engines: vLLM's 16, kvflow's 32, …): each node is matched and
credited at its own block size, and its blocks are converted to the unit (``× its size / unit``),
so two nodes holding the same cached tokens get the same credit, and the same load in tokens
weighs the same. In a fleet of one block size every factor is 1: the costs are the blocks as they are.

* ``prefill_blocks``: the prompt's full blocks minus the node's *contiguous* cached prefix (a
  mixed fleet: the most tokens any candidate's full blocks cover, in units, minus the prefix), where a
  GPU block counts 1 and a host-tier block ``host_credit`` (0.75: it must be copied back first);
  a prefix whose deepest block is below the default priority counts ``low_priority_credit`` of
  that (eviction takes leaves first: it is the next to erode, maybe before the request lands).
* ``decode_blocks``: the node's load in blocks — the blocks its running requests hold
  (``active_blocks`` from its heartbeat), plus ``queued_weight_blocks`` per request waiting there,
  plus the blocks of the requests the router sent it and has not seen finish (state in PostgreSQL
  lags; the router's own count does not).

Nodes that are ``stale``, ``gone``, ``suspect`` or ``unreachable`` are never chosen; a ``resyncing``
node's holdings are not trusted (it may be chosen for its load, with no prefix credit). Nodes over the
load threshold are filtered out first (unless all are). The lowest cost wins; ties go to the lower
load, then the node id. With ``temperature > 0`` the choice is sampled with probability ∝ exp(−Δcost / T).

What only the router knows (which nodes failed it lately, what it has sent them, which of its
requests have finished since a node's last heartbeat) is laid over the nodes' rows by
:func:`overlay`, pure as well, before :func:`decide`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from eventbus.protocol import DEFAULT_PRIORITY, NodeId
from routing_api.bounds import bounded_loads, load_cap, with_allowance, within_bound


@dataclass(frozen=True)
class RoutingWeights:
    """Every weight of the decision (``KVFLOW_ROUTER_…`` in ``routing_api.config``).

    The defaults are the policy ``kvflow sim`` measures as kvflow's (``kvflow.sim.routing``): what
    a router runs with no settings is what the docs' tables report (docs/router.md, "Which data
    chose each default"). A setting away from them is an operator's departure from that policy.
    """

    #: a cached block is worth 24 blocks of load: the cost follows the cache, the bounds keep the balance
    overlap_weight: float = 24.0
    host_credit: float = 0.75
    low_priority_credit: float = 0.9
    queued_weight_blocks: float = 8.0
    #: A node whose load exceeds this share of its GPU blocks is filtered out first.
    busy_fraction: float = 0.95
    temperature: float = 0.0
    #: Bounded loads (ε of Mirrokni, Thorup & Zadimoghaddam 2018): a node whose load exceeds (1 + ε) × the
    #: fleet's mean load, this request counted, is not eligible (:func:`within_bound`); 0: off (the cost alone).
    load_bound: float = 0.75
    #: Bounded work (with ``load_bound`` on): a node whose prefill work routed lately (:class:`RoutedWork`)
    #: exceeds (1 + this) × the fleet's mean, the request counted, is not eligible; 0: off.
    work_bound: float = 0.25
    #: The time constant of that work's decay, in seconds.
    work_tau_s: float = 60.0
    #: The tail guard (:mod:`routing_api.prefill`): a request whose predicted TTFT on the cost's
    #: choice, queued, is above this quantile of the recent choices' goes where it starts soonest,
    #: among nodes whose cached share of the prompt is within ``ttft_tolerance`` of the choice's
    #: and whose work lately is at most ``ttft_work_slack`` × its, if sooner by more than the
    #: prefill the move gives up (the tokens the choice holds and that node does not); 0: off.
    ttft_quantile: float = 0.9
    ttft_tolerance: float = 0.35
    ttft_work_slack: float = 1.1
    #: The bound gate (a ratio of predicted TTFTs; 0: off) and the queue tiebreak (:func:`routing_api.prefill.gate`).
    bound_gate: float = 0.5
    queue_tiebreak: bool = True
    #: Hubs (:mod:`routing_api.hubs`): a prefix this many distinct blocks followed is copied ahead; 0: off.
    hub_fanout: int = 16
    #: The load bound never tighter than the mean plus this many spreads of a sum of requests in hand
    #: (:mod:`routing_api.bounds`); 0: off.
    noise_allowance: float = 2.0


#: The one home of the weights' defaults (``RouterSettings`` takes its defaults from here).
DEFAULT_WEIGHTS = RoutingWeights()


@dataclass(frozen=True)
class NodeView:
    node_id: NodeId
    url: str
    status: str
    capacity_gpu: int
    active_blocks: int = 0
    active_requests: int = 0
    queued_requests: int = 0
    inflight_requests: int = 0
    inflight_blocks: int = 0
    #: why this node cannot serve this request at all (another model, another block size); "" if it can
    excluded: str = ""
    #: when the node took the heartbeat that ``active_blocks``/``active_requests`` come from
    #: (``NodeStats.ts``, epoch seconds; 0: unknown)
    stats_ts: float = 0.0
    #: the node's tokens per block, which every block count of this view is in (0: the decision's)
    block_size: int = 0
    #: the prefill work this router sent the node lately: its decayed uncached blocks (:class:`RoutedWork`)
    routed_work: float = 0.0
    #: what serves the node (``NodeStats.engine``): the words its requests carry retention in
    engine: str = "kvflow"


@dataclass
class Candidate:
    node_id: NodeId
    url: str
    status: str
    eligible: bool
    gpu_blocks: int = 0
    host_blocks: int = 0
    cached_credit: float = 0.0
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    cost: float = math.inf
    busy: bool = False
    #: its load is over the load bound (:func:`within_bound`): not chosen
    over_bound: bool = False
    #: requests in hand: running and queued (heartbeat) plus in flight from this router
    requests: int = 0
    reason: str = ""
    #: the node's block size, which ``gpu_blocks``, ``host_blocks`` and ``prompt_blocks`` are in
    #: (``cached_credit``, ``prefill_blocks``, ``decode_blocks`` and ``cost`` are in the decision's)
    block_size: int = 0
    #: the prompt's full blocks at the node's block size (what its in-flight count takes on)
    prompt_blocks: int = 0
    #: the prefill work routed to it lately, in the decision's blocks (``NodeView.routed_work``)
    work: float = 0.0
    #: what serves the node (``NodeView.engine``)
    engine: str = "kvflow"

    @property
    def matched_blocks(self) -> int:
        return self.gpu_blocks + self.host_blocks

    @property
    def matched_tokens(self) -> int:
        """The prompt's tokens cached on the node (host-tier blocks included)."""
        return (self.gpu_blocks + self.host_blocks) * self.block_size


@dataclass
class Decision:
    chosen: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)
    total_blocks: int = 0
    reason: str = ""

    def ranked(self) -> list[Candidate]:
        """Every eligible candidate in the order to try them: the chosen one, then the others by
        cost, those over the load threshold last (a proxy whose connection is refused goes on to
        the next). Computed on demand: a decision that is not proxied never needs it."""
        if self.chosen is None:
            return []
        others = [c for c in self.candidates if c.eligible and c is not self.chosen]
        others.sort(key=lambda c: (c.busy, c.over_bound, c.cost, c.decode_blocks, c.node_id))
        return [self.chosen, *others]


#: A node's holdings: SQL-or-wire block hash → (cache level, priority).
Holdings = Mapping[int, tuple[int, int]]


@dataclass(frozen=True)
class PrefixMatch:
    """A node's contiguous cached prefix of a prompt: blocks on the GPU, then on the host (a node's
    cache keeps every ancestor of a GPU block on the GPU), and whether the deepest one is below the
    default priority (eviction takes leaves first: that prefix is the next to erode)."""

    gpu: int = 0
    host: int = 0
    leaf_low: bool = False

    def credit(self, w: RoutingWeights) -> float:
        c = self.gpu + w.host_credit * self.host
        return c * w.low_priority_credit if self.leaf_low else c


NO_MATCH = PrefixMatch()


def prefix_match(prompt_hashes: Sequence[int], holdings: Holdings) -> PrefixMatch:
    """The node's contiguous cached prefix of the prompt (``kvflow_prefix_matches()`` in SQL computes
    the same, by bisection, for the caches a node can have)."""
    gpu = host = 0
    leaf_priority = DEFAULT_PRIORITY
    for h in prompt_hashes:
        held = holdings.get(h)
        if held is None:
            break
        level, leaf_priority = held
        if level == 0:
            gpu += 1
        else:
            host += 1
    return PrefixMatch(gpu, host, leaf_priority < DEFAULT_PRIORITY)


class InflightCount(Protocol):
    """What the router has sent a node and not seen finish (``routing_api.state.Inflight``)."""

    requests: int
    blocks: int


@dataclass(frozen=True, slots=True)
class Finished:
    """A request the router proxied to a node and saw finish, on the wall clock (as ``NodeStats.ts``).

    ``blocks`` are the prompt blocks it counted in flight for the request."""

    started: float
    ended: float
    blocks: int


def finished_since(finished: Sequence[Finished], stats_ts: float) -> tuple[int, int]:
    """The requests, and their blocks, that a heartbeat taken at ``stats_ts`` still counts as running
    although the router has seen them finish: started before it, ended after it.

    A node's heartbeat (every 1–2 s) counts the blocks its running requests hold; for up to a
    heartbeat's interval after a request ends, the row in ``nodes`` still counts it as load, and the
    node that holds a conversation's history looks busier than an idle one. The router knows
    which of its own requests ended since: that load is gone. A request that started after the
    heartbeat was never counted by it; one that ended before it is not counted either.

    Args:
        finished: the node's finished requests in the order they ended (only those that ended
            after the heartbeat are looked at).
        stats_ts: when the node took the heartbeat (``NodeStats.ts``; the router's wall clock is
            assumed to agree with the node's, as NTP keeps them).

    Returns:
        ``(requests, blocks)``; ``(0, 0)`` when the heartbeat's time is unknown (``stats_ts`` 0).
    """
    requests = blocks = 0
    if stats_ts > 0:
        for f in reversed(finished):
            if f.ended <= stats_ts:
                break
            if f.started < stats_ts:
                requests += 1
                blocks += f.blocks
    return requests, blocks


@dataclass(frozen=True, slots=True)
class RoutedWork:
    """The prefill work the router sent a node: the uncached prompt blocks of each request it routed
    there (its prompt's blocks less the node's cached prefix when it decided, in the node's block
    size), summed with a decay of time constant ``tau``, as of ``ts`` (the clock of ``overlay``'s
    ``now``). What a node has in hand comes and goes within a request or two; this adds up."""

    value: float = 0.0
    ts: float = 0.0

    def at(self, now: float, tau: float) -> float:
        """The work decayed to ``now``."""
        return self.value * math.exp(-max(0.0, now - self.ts) / tau) if tau > 0 else self.value

    def plus(self, blocks: float, now: float, tau: float) -> RoutedWork:
        """The work with a request of ``blocks`` uncached blocks routed at ``now``."""
        return RoutedWork(self.at(now, tau) + blocks, now)


def routed_work(c: Candidate) -> int:
    """A decision's prefill work on its chosen node: the prompt's blocks it did not hold (node's blocks)."""
    return max(0, c.prompt_blocks - c.matched_blocks)


def overlay(views: Sequence[NodeView], suspect_until: Mapping[NodeId, float], inflight: Mapping[NodeId, InflightCount],
            now: float, finished: Mapping[NodeId, Sequence[Finished]] | None = None,
            work: Mapping[NodeId, RoutedWork] | None = None, tau: float = 0.0) -> list[NodeView]:
    """The nodes' views with the router's own state laid over them.

    PostgreSQL knows what the nodes reported; only this router process knows which nodes failed a
    proxied request lately, what it has sent them that has not finished, and what has finished
    since the heartbeat a node's row comes from.

    Args:
        views: every node's view from the ``nodes`` table (``FleetView.views``).
        suspect_until: node id → ``time.monotonic()`` until which the node is avoided.
        inflight: node id → the requests and prompt blocks proxied to it and not finished.
        now: the present, on the clock of ``suspect_until``.
        finished: node id → the requests proxied to it that have finished lately (the wall clock).
        work: node id → the prefill work routed to it (:class:`RoutedWork`, on the clock of ``now``),
            decayed to ``now`` with the time constant ``tau`` into ``routed_work``.

    Returns:
        The views in the same order: a node suspect at ``now`` gets the status ``suspect``, a node
        with requests in flight gets their counts, a node whose heartbeat still counts requests
        that have finished since (:func:`finished_since`) gets ``active_requests`` and
        ``active_blocks`` less theirs (never below zero); every other view is the very object it was.
    """
    out = list(views)
    if not suspect_until and not inflight and not finished and not work:
        return out
    for i, v in enumerate(out):
        suspect = suspect_until.get(v.node_id, 0) > now
        inf = inflight.get(v.node_id)
        ended = finished.get(v.node_id) if finished else None
        gone_requests, gone_blocks = finished_since(ended, v.stats_ts) if ended else (0, 0)
        rw = work.get(v.node_id) if work else None
        done = rw.at(now, tau) if rw is not None else 0.0
        if suspect or gone_requests or done or (inf is not None and (inf.requests or inf.blocks)):
            out[i] = dataclasses.replace(
                v, status="suspect" if suspect else v.status,
                inflight_requests=inf.requests if inf else 0, inflight_blocks=inf.blocks if inf else 0,
                active_requests=max(0, v.active_requests - gone_requests),
                active_blocks=max(0, v.active_blocks - gone_blocks), routed_work=done)
    return out


def decide(total: int, nodes: Sequence[NodeView], matches: Mapping[NodeId, PrefixMatch], w: RoutingWeights,
           rng: random.Random | None = None, *, block_size: int = 0, tokens: int | None = None) -> Decision:
    """Choose a node for a prompt of ``total`` full blocks, given each node's cached prefix of it.

    Args:
        total: the prompt's full blocks at ``block_size``.
        nodes: every node's view; a view's ``block_size`` (0: ``block_size``) is the one its
            blocks, its load and its match are in.
        matches: each node's cached prefix of the prompt, computed at the node's own block size.
        w: the weights.
        rng: for ``w.temperature > 0``.
        block_size: the decision's block size, the unit of every cost (0: unknown; then every
            view must be of it).
        tokens: the prompt's tokens; needed when a view's block size is not ``block_size``.

    Raises:
        ValueError: a view of another block size, and no ``tokens`` (or no ``block_size``).
    """
    sizes = {n.block_size or block_size for n in nodes if n.status in ("live", "resyncing") and not n.excluded}
    mixed = bool(sizes - {block_size})
    if mixed and (tokens is None or block_size <= 0):
        raise ValueError("nodes of another block size than the decision's need the prompt's tokens and a block size")
    # what is to prefill is measured from the same length for every node: the most tokens any
    # candidate's full blocks cover (in units of the decision's block size)
    ref: float = max(tokens // b * b for b in sizes | {block_size}) / block_size if mixed and tokens else total
    cands: list[Candidate] = []
    for n in nodes:
        b = n.block_size or block_size
        blocks = total if b == block_size else tokens // b if tokens is not None and b > 0 else 0
        c = Candidate(n.node_id, n.url, n.status, eligible=n.status in ("live", "resyncing") and not n.excluded,
                      block_size=b, prompt_blocks=blocks, engine=n.engine)
        if not c.eligible:  # a gone node is gone, whatever else it is
            c.reason = f"{n.status}: never chosen" if n.status == "gone" or not n.excluded else n.excluded
            cands.append(c)
            continue
        _score(c, n, matches.get(n.node_id, NO_MATCH), ref, 1.0 if b == block_size else b / block_size, w)
        cands.append(c)
    eligible = [c for c in cands if c.eligible]
    if not eligible:
        return Decision(None, cands, total, "no live node")
    chosen, pool = _choose(eligible, ref, w, rng)
    chosen.reason = _explain(chosen, pool, block_size if mixed else 0)
    return Decision(chosen, cands, total, chosen.reason)


def _choose(eligible: list[Candidate], ref: float, w: RoutingWeights,
            rng: random.Random | None) -> tuple[Candidate, list[Candidate]]:
    """The choice among the eligible candidates, and the pool it was made from: busy nodes out
    (unless all are), then — with ``load_bound`` — the nodes over the bounds out (the load bound with
    its noise allowance, :mod:`routing_api.bounds`), the lowest cost wins (sampled with
    ``temperature``; with the bound, ties at random)."""
    if w.load_bound > 0:
        bounded_loads(eligible, w)
    pool = [c for c in eligible if not c.busy] or eligible
    for c in eligible:
        if c.busy and c not in pool:
            c.reason = c.reason or "over the load threshold"
    if w.load_bound > 0 and len(pool) > 1:
        cap = load_cap([c.decode_blocks for c in eligible], ref, w.load_bound)
        requests = sum(c.requests for c in eligible)
        unit = sum(c.decode_blocks for c in eligible) / requests if requests else ref
        pool = within_bound(pool, with_allowance(cap, w.load_bound, unit, w.noise_allowance))
    if w.load_bound > 0 and w.work_bound > 0 and len(pool) > 1:
        least = min(c.prefill_blocks for c in pool)
        pool = within_bound(pool, load_cap([c.work for c in eligible], least, w.work_bound), work=True)
    pool.sort(key=lambda c: (c.cost, c.decode_blocks, c.node_id))
    chosen = pool[0]
    if w.temperature > 0 and len(pool) > 1:
        r = rng or random.Random()
        best = pool[0].cost
        weights = [math.exp(-(c.cost - best) / w.temperature) for c in pool]
        chosen = r.choices(pool, weights=weights, k=1)[0]
    elif w.load_bound > 0 and rng is not None and len(pool) > 1:
        chosen = _any_of_the_best(pool, rng)
    return chosen, pool


def _any_of_the_best(pool: list[Candidate], rng: random.Random) -> Candidate:
    """One of the candidates of the lowest cost and load, at random (``pool`` sorted): equal nodes share
    what none of them holds instead of the first by id taking it all."""
    best = pool[0]
    tied = [c for c in pool if c.cost == best.cost and c.decode_blocks == best.decode_blocks]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _score(c: Candidate, n: NodeView, m: PrefixMatch, ref: float, scale: float, w: RoutingWeights) -> None:
    """An eligible candidate's cost: ``ref`` units to prefill less its credit, plus its load; ``scale``
    converts the node's blocks to the decision's (1.0 when they are the same size)."""
    if n.status == "live":
        c.gpu_blocks, c.host_blocks, c.cached_credit = m.gpu, m.host, m.credit(w) * scale
    else:
        c.reason = "resyncing: cached blocks not trusted"
    c.prefill_blocks = ref - c.cached_credit
    c.decode_blocks = (n.active_blocks + n.inflight_blocks) * scale + w.queued_weight_blocks * n.queued_requests
    c.requests = n.active_requests + n.inflight_requests + n.queued_requests
    c.work = n.routed_work * scale
    c.cost = w.overlap_weight * c.prefill_blocks + c.decode_blocks
    c.busy = n.capacity_gpu > 0 and n.active_blocks + n.inflight_blocks > w.busy_fraction * n.capacity_gpu


def _explain(c: Candidate, pool: list[Candidate], unit: int = 0) -> str:
    """Why ``c`` won; ``unit``: the decision's block size when the fleet mixes sizes (0: it does not)."""
    if unit:
        load = f"{c.decode_blocks:.0f}" if c.decode_blocks == int(c.decode_blocks) else f"{c.decode_blocks:.2f}"
        parts = [f"cost {c.cost:.2f} = {c.prefill_blocks:.2f} blocks to prefill + {load} blocks of load"
                 f" (blocks of {unit} tokens)"]
    else:
        parts = [f"cost {c.cost:.2f} = {c.prefill_blocks:.2f} blocks to prefill + {c.decode_blocks:.0f} blocks of load"]
    if c.matched_blocks:
        of = f" of {c.block_size} tokens" if unit else ""
        parts.append(f"{c.matched_blocks}/{c.prompt_blocks} prompt blocks{of} cached ({c.host_blocks} on host)")
    others = [o for o in pool if o is not c]
    if others:
        nxt = min(others, key=lambda o: o.cost)
        parts.append(f"next best {nxt.node_id} at {nxt.cost:.2f}")
    return "; ".join(parts)
