"""The JSON the router answers with, as pure functions of decisions and rows (no I/O)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from routing_api.scoring import Candidate, Decision


def candidate_json(c: Candidate) -> dict[str, Any]:
    """One candidate of a decision with the parts of its score (``cost`` None: not eligible).

    Its blocks (``matched_blocks``, ``gpu_blocks``, ``host_blocks``, ``prompt_blocks``) are in its
    own ``block_size``; its score (``cached_credit``, ``prefill_blocks``, ``decode_blocks``, ``cost``)
    in the decision's (``cost_block_size``)."""
    return {"node_id": c.node_id, "status": c.status, "eligible": c.eligible,
            "matched_blocks": c.gpu_blocks + c.host_blocks, "gpu_blocks": c.gpu_blocks,
            "host_blocks": c.host_blocks, "block_size": c.block_size, "prompt_blocks": c.prompt_blocks,
            "matched_tokens": c.matched_tokens, "cached_credit": round(c.cached_credit, 3),
            "prefill_blocks": round(c.prefill_blocks, 3), "decode_blocks": round(c.decode_blocks, 3),
            "cost": None if c.cost == math.inf else round(c.cost, 3), "busy": c.busy, "reason": c.reason}


def decision_body(decision: Decision, prompt_tokens: int, prompt_blocks: int, block_size: int,
                  elapsed_s: float, *, degraded: bool = False, gone_nodes: int = 0) -> dict[str, Any]:
    """The body of ``POST /v1/route``: the choice (None when there is none) and every candidate.

    ``block_size``, ``prompt_blocks``, ``matched_blocks`` and ``matched_tokens`` are the chosen
    node's, in its block size (``matched_tokens = matched_blocks × block_size``); without a choice,
    the decision's. ``cached_tokens`` predicts the node's ``usage.prompt_tokens_details.cached_tokens``.
    ``cost_block_size`` is the decision's block size, which the candidates' costs
    are in (in a fleet of one block size, ``block_size`` as well).

    Args:
        decision: what :func:`routing_api.scoring.decide` chose.
        prompt_tokens: the prompt's tokens.
        prompt_blocks: its full blocks in ``block_size``.
        block_size: the decision's block size (the unit of its costs).
        elapsed_s: the time the decision took (``decision_ms``, to the microsecond).
        degraded: made without PostgreSQL (the last known fleet, no prefix credit).
        gone_nodes: the nodes that are ``gone`` (no candidates; only counted).
    """
    chosen = decision.chosen
    size, blocks = block_size, prompt_blocks
    if chosen is not None and chosen.block_size:  # (a candidate of decide() without a block size: ours)
        size, blocks = chosen.block_size, chosen.prompt_blocks
    matched = chosen.matched_blocks * size if chosen else 0
    return {
        "node_id": chosen.node_id if chosen else None,
        "url": chosen.url if chosen else None,
        "matched_blocks": chosen.matched_blocks if chosen else 0,
        "matched_tokens": matched,
        # What the node will report as usage.prompt_tokens_details.cached_tokens: the matched tokens,
        # all but the last when every token is matched (the node computes that one again for its logits).
        "cached_tokens": min(matched, max(prompt_tokens - 1, 0)),
        "prompt_tokens": prompt_tokens, "prompt_blocks": blocks, "block_size": size, "cost_block_size": block_size,
        "reason": decision.reason, "decision_ms": round(elapsed_s * 1000, 3), "degraded": degraded,
        "candidates": [candidate_json(c) for c in decision.candidates], "gone_nodes": gone_nodes,
    }


def node_json(row: Mapping[str, Any], router_inflight: int, suspect: bool) -> dict[str, Any]:
    """A ``nodes`` row as JSON, with what this router knows of the node.

    Args:
        row: the row (``routing_api.queries.NODES``).
        router_inflight: the requests this process proxied to the node and has not seen finish.
        suspect: whether the node failed a proxied request within ``suspect_s``.

    Returns:
        The row's columns (``last_seen`` in ISO 8601, ``counters`` decoded, ``silent_s`` and
        ``stats_ts``, the latest heartbeat's time, as floats), plus ``router_inflight`` and ``suspect``.
    """
    d = dict(row)
    d["last_seen"] = d["last_seen"].isoformat() if d.get("last_seen") else None
    d["counters"] = json.loads(d["counters"]) if isinstance(d.get("counters"), str) else d.get("counters")
    d["silent_s"] = float(d["silent_s"]) if d.get("silent_s") is not None else None
    if "stats_ts" in d:
        d["stats_ts"] = float(d["stats_ts"]) if d["stats_ts"] is not None else None
    d["router_inflight"] = router_inflight
    d["suspect"] = suspect
    return d
