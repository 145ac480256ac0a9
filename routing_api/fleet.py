"""The fleet as one decision sees it: the ``nodes`` rows turned into :class:`NodeView` s (pure).

A fleet may mix block sizes (engines bridged in: vLLM's blocks of 16, kvflow's 32, SGLang's pages):
each node is viewed in its own size, and the candidates are grouped by (model, block size), so
that a prompt is hashed and matched once per size and each node credited at its own.

A read of the ``nodes`` table serves every decision until the next read, so the views are derived
once per read and model (``routing_api.state.FleetCache``); each decision then lays the router's
own state over them (:func:`routing_api.scoring.overlay`).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eventbus.hashing import DEFAULT_BLOCK_SIZE
from eventbus.protocol import ENGINE_KVFLOW, NodeId
from routing_api.scoring import NodeView, PrefixMatch

#: The block size when no node reports one.
FALLBACK_BLOCK_SIZE = DEFAULT_BLOCK_SIZE

Row = Mapping[str, Any]


def fleet_block_size(rows: Sequence[Row]) -> int:
    """The decision's block size, the unit its costs are in: the one most live nodes report (then
    any node's; 32).

    Nodes of other sizes are candidates as well (each matched at its own size, its blocks converted
    to this one, :func:`routing_api.scoring.decide`), unless ``KVFLOW_ROUTER_BLOCK_SIZE`` is set.

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


#: The candidates that may be credited a prefix, by (model, block size).
Groups = Mapping[tuple[str | None, int], tuple[NodeId, ...]]


@dataclass(frozen=True)
class FleetView:
    """One read of the ``nodes`` table as a request for ``model`` sees it (derived once per read):
    the decision's block size, every node's view without the router's own state (suspicion,
    in-flight requests), which each decision lays over it, and the block sizes to hash the prompt
    in. Nodes that are ``gone`` are no candidates: only their number is kept."""

    #: the decision's block size: the unit of its costs (``KVFLOW_ROUTER_BLOCK_SIZE`` or the fleet's)
    block_size: int
    views: tuple[NodeView, ...]
    #: how many rows are ``gone`` (left out of ``views``)
    gone: int = 0
    #: the live candidates (a URL, not excluded) by (model, block size): those a prefix may be credited to
    groups: Groups = field(default_factory=dict)
    #: the distinct block sizes of ``groups``, ascending: the prompt is hashed and matched once in each
    sizes: tuple[int, ...] = ()

    def own_size_matches(self, found: Mapping[int, Mapping[NodeId, PrefixMatch]]) -> Mapping[NodeId, PrefixMatch]:
        """Each node's prefix match at its own block size, out of the matches found per size.

        Args:
            found: block size → node id → the node's cached prefix of the prompt hashed in that size.

        Returns:
            node id → its match, only from the size of its view (a node is never credited with
            blocks of another size, were a hash of one to equal a hash of the other).
        """
        if len(found) == 1 and len(self.sizes) == 1:
            size, matches = next(iter(found.items()))
            if size == self.sizes[0]:
                return matches  # one size: every candidate is of it
        out: dict[NodeId, PrefixMatch] = {}
        for (_, size), ids in self.groups.items():
            at = found.get(size)
            if at:
                out.update((i, at[i]) for i in ids if i in at)
        return out


def fleet_view(rows: Sequence[Row], model: str | None, block_size: int | None = None) -> FleetView:
    """Every node's view for a request of ``model`` (None: any), in its own block size.

    A node of another model is ``excluded`` (with the reason), as is, with ``block_size`` set, a
    node of another block size; a node known only from its events (no heartbeat has given its URL)
    is ``unreachable``; a ``gone`` node has no view (``FleetView.gone`` counts them). The live
    candidates are grouped by (model, block size): the prompt's hashes depend on the block size,
    not on the model, so it is hashed once per distinct size (``FleetView.sizes``).

    Args:
        rows: ``nodes`` rows (``routing_api.queries.NODES``).
        model: the model the request names, or None.
        block_size: ``KVFLOW_ROUTER_BLOCK_SIZE``: the one size prompts are hashed in, nodes of
            others excluded; None: every size, the costs in :func:`fleet_block_size` of the nodes
            serving ``model``.

    Returns:
        The decision's block size, one view per row that is not gone, in the rows' order (each
        with the node's block size; the decision's when its row has none), the number gone, and
        the groups.
    """
    serving = [r for r in rows if model is None or r["model"] == model]
    size = block_size or fleet_block_size(serving)
    views = []
    gone = 0
    groups: dict[tuple[str | None, int], list[NodeId]] = {}
    for r in rows:
        if r["status"] == "gone":
            gone += 1
            continue
        own = int(r["block_size"] or size)
        excluded = ""
        if model is not None and r["model"] != model:
            excluded = f"serves {r['model'] or 'an unknown model'}, not {model}"
        elif block_size and own != size:
            excluded = f"block size {own}; this fleet's prompts are hashed in blocks of {size}"
        # a node known from its events only (no heartbeat has said where it is) is unreachable
        status = r["status"] if r["url"] else "unreachable"
        views.append(NodeView(r["node_id"], r["url"] or "", status, r["capacity_gpu"], r["active_blocks"],
                              r["active_requests"], r["queued_requests"], excluded=excluded,
                              stats_ts=float(r.get("stats_ts") or 0.0), block_size=own,
                              engine=str(r.get("engine") or ENGINE_KVFLOW)))
        if status == "live" and not excluded:
            groups.setdefault((r["model"], own), []).append(r["node_id"])
    return FleetView(size, tuple(views), gone, {k: tuple(v) for k, v in groups.items()},
                     tuple(sorted({b for _, b in groups})))
