"""The fleet as one decision sees it: the ``nodes`` rows turned into :class:`NodeView` s (pure).

A read of the ``nodes`` table serves every decision until the next read, so the views are derived
once per read and model (``routing_api.state.FleetCache``); each decision then lays the router's
own state over them (:func:`routing_api.scoring.overlay`).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from routing_api.scoring import NodeView

#: The block size when no node reports one.
FALLBACK_BLOCK_SIZE = 32

Row = Mapping[str, Any]


def fleet_block_size(rows: Sequence[Row]) -> int:
    """The block size prompts are hashed in: the one most live nodes report (then any node's; 32).

    Hashes depend on block boundaries, so one decision uses one size; a node with another size
    is not a candidate (see ``excluded`` in the decision).

    Args:
        rows: ``nodes`` rows (``status``, ``block_size``).

    Returns:
        The most common size among live nodes, else among all, the smaller on a tie; else 32.
    """
    for pool in ([r for r in rows if r["status"] == "live"], rows):
        sizes: collections.Counter[int] = collections.Counter(int(r["block_size"]) for r in pool if r["block_size"])
        if sizes:
            return min(sizes, key=lambda b: (-sizes[b], b))
    return FALLBACK_BLOCK_SIZE


@dataclass(frozen=True)
class FleetView:
    """One read of the ``nodes`` table as a request for ``model`` sees it (derived once per read):
    the block size prompts are hashed in, and every node's view without the router's own state
    (suspicion, in-flight requests), which each decision lays over it. Nodes that are ``gone``
    are no candidates: only their number is kept."""

    block_size: int
    views: tuple[NodeView, ...]
    #: how many rows are ``gone`` (left out of ``views``)
    gone: int = 0


def fleet_view(rows: Sequence[Row], model: str | None, block_size: int | None = None) -> FleetView:
    """Every node's view for a request of ``model`` (None: any), hashed in ``block_size`` (None: the fleet's).

    A node of another model or another block size is ``excluded`` (with the reason); a node known
    only from its events (no heartbeat has given its URL) is ``unreachable``; a ``gone`` node has no
    view (``FleetView.gone`` counts them).

    Args:
        rows: ``nodes`` rows (``routing_api.queries.NODES``).
        model: the model the request names, or None.
        block_size: ``KVFLOW_ROUTER_BLOCK_SIZE``, or None to take :func:`fleet_block_size` of the
            nodes serving ``model``.

    Returns:
        The block size, one view per row that is not gone, in the rows' order, and the number gone.
    """
    serving = [r for r in rows if model is None or r["model"] == model]
    size = block_size or fleet_block_size(serving)
    views = []
    gone = 0
    for r in rows:
        if r["status"] == "gone":
            gone += 1
            continue
        excluded = ""
        if model is not None and r["model"] != model:
            excluded = f"serves {r['model'] or 'an unknown model'}, not {model}"
        elif r["block_size"] and r["block_size"] != size:
            excluded = f"block size {r['block_size']}; this fleet's prompts are hashed in blocks of {size}"
        # a node known from its events only (no heartbeat has said where it is) is unreachable
        status = r["status"] if r["url"] else "unreachable"
        views.append(NodeView(r["node_id"], r["url"] or "", status, r["capacity_gpu"], r["active_blocks"],
                              r["active_requests"], r["queued_requests"], excluded=excluded,
                              stats_ts=float(r.get("stats_ts") or 0.0)))
    return FleetView(size, tuple(views), gone)
