"""The weights the exact decision tests are written for: every field at the value it had as the
router's default before the defaults became the policy ``kvflow sim`` measures (overlap 1 —
Dynamo's cost — the load bound 0.75, no work bound, no tail guard, no bound gate or queue
tiebreak, no hubs, no noise allowance); a test names what it changes."""

from __future__ import annotations

import dataclasses
from typing import Any

from routing_api.config import RouterSettings
from routing_api.scoring import RoutingWeights

BASE = RoutingWeights(overlap_weight=1.0, load_bound=0.75, work_bound=0.0, ttft_quantile=0.0, bound_gate=0.0,
                      queue_tiebreak=False, hub_fanout=0, noise_allowance=0.0)


def weights(**changes: Any) -> RoutingWeights:
    """:data:`BASE` with ``changes``."""
    return dataclasses.replace(BASE, **changes)


def settings(**changes: Any) -> RouterSettings:
    """A router's settings with :data:`BASE`'s weights, and ``changes``."""
    return RouterSettings(**{**dataclasses.asdict(BASE), **changes})
