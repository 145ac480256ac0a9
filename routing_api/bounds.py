"""The load and work bounds of :func:`routing_api.scoring.decide`: bounded loads (Mirrokni, Thorup &
Zadimoghaddam), each request in hand counted at least at the fleet's mean, and the load bound's
noise allowance.

**The noise allowance** (``RoutingWeights.noise_allowance``, z; the load bound only). A bound of
``(1 + ε)`` × the mean tells imbalance from chance only where each node's share is many requests.
The load bound counts the blocks each node has *in hand* — on a fleet that is not saturated, a
few requests each — and a node's count of a few requests varies by about the square root of its
mean times a request's size (the spread of a sum of that many requests): ``(1 + ε)`` × the mean is
then inside that spread, and the bound moves requests off the node holding their prefix for an
imbalance that is only the luck of the draw. So the load bound is never tighter than
``mean + z √(mean × blocks per request in hand)``. Where the fleet is busy the ``(1 + ε)`` bound is
the larger and nothing changes.

The work bound has no allowance: it counts the prefill routed over a window of ``work_tau_s``
(60 s), many requests even on a light fleet, so it is an average already, and it is what keeps a
node that the cache keeps choosing (a hub's holder, an agent type's tools) from taking more than
its share of the prefill. With the allowance on both bounds, such nodes took 1.18 × the mean
prefill on system_prompt and 1.24 × on hot_prefixes (docs/research/2026-12-router-noise-allowance.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Bounded(Protocol):
    """What the bounds read and set of a candidate (``routing_api.scoring.Candidate``; a protocol, so
    that this module imports nothing of the scoring that imports it)."""

    decode_blocks: float
    requests: int
    prefill_blocks: float
    work: float
    cost: float
    over_bound: bool
    reason: str


class OverlapWeight(Protocol):
    """The weight the cost is recomputed with (``routing_api.scoring.RoutingWeights``)."""

    @property
    def overlap_weight(self) -> float: ...


C = TypeVar("C", bound=Bounded)


def with_allowance(cap: float, bound: float, unit: float, z: float) -> float:
    """``cap`` (``(1 + bound)`` × the mean), but at least the mean plus z × √(mean × ``unit``)."""
    if z <= 0:
        return cap
    mean = cap / (1 + bound)
    return max(cap, mean + z * math.sqrt(max(mean, 0.0) * max(unit, 0.0)))


def bounded_loads(cands: Sequence[Bounded], w: OverlapWeight) -> None:
    """Each candidate's load for the bound and the cost: its blocks in hand (``decode_blocks``), but
    each request in hand counted at least at the fleet's mean blocks per request in hand.

    Blocks alone make a node serving many short prompts look light: it attracts every new prompt,
    and its requests are the ones with the most to prefill (the short prompts nothing else shares),
    while a node under a hot prefix holds long prompts that it barely computes. Requests alone let
    long prompts pile up behind one another. A node is as loaded as the larger of the two, in blocks.
    ``cost`` is updated with the load.
    """
    blocks = sum(c.decode_blocks for c in cands)
    requests = sum(c.requests for c in cands)
    if not requests:
        return
    per_request = blocks / requests
    for c in cands:
        load = max(c.decode_blocks, c.requests * per_request)
        if load != c.decode_blocks:
            c.decode_blocks = load
            c.cost = w.overlap_weight * c.prefill_blocks + load


def load_cap(loads: Sequence[float], request: float, bound: float) -> float:
    """The load bound: ``(1 + bound)`` × the fleet's mean load with the request counted.

    Consistent hashing with bounded loads (Mirrokni, Thorup & Zadimoghaddam, SODA 2018) gives each
    bin a capacity of ``⌈(1 + ε) m / n⌉`` for ``m`` balls (the new one counted) in ``n`` bins; a full
    bin takes no more, and the ball goes on to the next. Here a request weighs its prompt blocks.

    Args:
        loads: every eligible node's load (``decode_blocks``: the blocks it has in hand, in units).
        request: the request's blocks (what the router's in-flight count of its node takes on).
        bound: ε > 0.
    """
    return (1 + bound) * (sum(loads) + request) / len(loads)


def within_bound(pool: Sequence[C], cap: float, work: bool = False) -> list[C]:
    """The candidates of ``pool`` not over the load bound: whose load is at most ``cap``.

    A node over it takes no more requests, whatever it holds: a prefix it holds goes to the best
    node within the bound, which then holds it too, so a hot prefix ends up on as many nodes as its
    load needs. A node within the bound may take any request, however long (requests are not unit
    balls: a long prompt would otherwise find no node but an idle one), so a node's load exceeds
    ``cap`` by at most the request it took last — as the bound's rounding lets a bin exceed
    ``(1 + ε) m / n`` by less than one ball. If every node is over (possible only when the nodes
    over the load threshold were filtered out first), the least loaded ones remain.
    Candidates left out are marked ``over_bound``. ``work``: the bound on the prefill work routed
    lately (``Candidate.work``, the request's least prefill counted) instead of the load in hand.
    """
    def of(c: C) -> float:
        return c.work + c.prefill_blocks if work else c.decode_blocks

    ok = [c for c in pool if of(c) <= cap]
    if not ok:
        lowest = min(of(c) for c in pool)
        ok = [c for c in pool if of(c) == lowest]
    within = {id(c) for c in ok}
    what = "blocks of prefill work, routed lately and this one's" if work else "blocks of load"
    for c in pool:
        if id(c) not in within:
            c.over_bound = True
            c.reason = c.reason or f"over the load bound: {of(c):.0f} {what} > {cap:.1f}"
    return ok
