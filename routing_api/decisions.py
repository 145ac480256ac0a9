"""One routing decision, step by step: prepare the input, lay the router's state over the
fleet, decide (pure, ``routing_api.scoring``), record, and format the answer.

``POST /v1/route`` answers with the result; ``POST /v1/completions`` proxies to its choice.

Without PostgreSQL (``routing_api.queries.DatabaseUnavailable``) a decision is *degraded*: it
takes the last fleet read (nodes, URLs, load) and the router's own state, gives no prefix credit,
and says so (``"degraded": true``, ``kvflow_router_degraded_decisions_total``). A router that has
never read the fleet answers 503 ``no fleet known yet``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException

from eventbus.hashing import prompt_hash_heads
from eventbus.protocol import NodeId
from routing_api.errors import Unavailable
from routing_api.fleet import FleetView
from routing_api.hubs import Warmup, after_gate
from routing_api.prefill import gate, guard
from routing_api.queries import DatabaseUnavailable
from routing_api.schemas import decision_body
from routing_api.scoring import NO_MATCH, Decision, PrefixMatch, decide, overlay
from routing_api.state import RouterState

#: The reason of a degraded decision starts with this.
DEGRADED = "degraded (PostgreSQL unreachable): the last known fleet, by load alone"


@dataclass(slots=True)
class Prompt:
    """A request's prompt, ready to decide on: its tokens, its full blocks' hashes in each block size
    of the fleet that may serve it, the fleet's view."""

    tokens: Sequence[int]
    #: block size → the full blocks' hashes in it, packed 8 bytes each (``eventbus.hashing.prompt_hash_heads``):
    #: one entry per size of the live candidates (``FleetView.sizes``)
    hashed: dict[int, bytes]
    fleet: FleetView
    #: the fleet is the last one read: PostgreSQL could not be read for this decision
    degraded: bool = False

    @property
    def blocks(self) -> int:
        """The prompt's full blocks in the decision's block size (``fleet.block_size``)."""
        return len(self.tokens) // self.fleet.block_size

    @property
    def hashes(self) -> bytes:
        """The full blocks' hashes in the decision's block size (b"" if no live candidate has it)."""
        return self.hashed.get(self.fleet.block_size, b"")


@dataclass(slots=True)
class Routed:
    """A decision made: the decision, its answer's body (``POST /v1/route``), the prompt's blocks.

    ``prompt_blocks``, ``block_size`` and ``matched_tokens`` are the chosen node's (in a fleet of
    several block sizes, each candidate has its own: ``Candidate.prompt_blocks``, ``.block_size``,
    ``.matched_tokens``)."""

    decision: Decision
    body: dict[str, Any]
    prompt_blocks: int
    prompt: Prompt | None = None
    #: the decision's entry among the router's recent ones (``RouterState.recent``)
    recent: dict[str, Any] | None = None
    #: the hub copy the decision calls for (``routing_api.hubs``; the proxy sends it: ``routing_api.warmups``)
    warmup: Warmup | None = None

    @property
    def matched_tokens(self) -> int:
        """The prompt's tokens cached on the chosen node (0 without one)."""
        matched: int = self.body["matched_tokens"]
        return matched

    @property
    def block_size(self) -> int:
        """The chosen node's block size (without one: the decision's)."""
        size: int = self.body["block_size"]
        return size


async def fleet_rows(state: RouterState) -> tuple[Sequence[Any], bool]:
    """The ``nodes`` rows, and whether they are the last ones read (PostgreSQL away: degraded).

    Raises:
        Unavailable: PostgreSQL could not be read, and never has been (no fleet known yet).
    """
    try:
        return await state.reader.nodes(), False
    except DatabaseUnavailable as exc:
        if not state.reader.known:
            raise Unavailable(f"no fleet known yet: {exc.message}") from exc
        return state.reader.last_nodes, True


async def prepare(state: RouterState, token_ids: Sequence[int] | None, text: str | None, lora_id: int | None,
                  salt: str | None, model: str | None, *, special_tokens: bool = True) -> Prompt:
    """Tokenize the prompt, and hash it in each block size of the fleet that may serve it.

    Args:
        state: the process's state (the reader, the tokenizer, the fleet views).
        token_ids: the prompt as token ids, or None for ``text``.
        text: the prompt as text (tokenized as the nodes do).
        lora_id: the LoRA adapter, part of every block's hash.
        salt: the cache salt (a tenant's name), part of the first block's hash.
        model: only nodes serving this model may be chosen (None: any).
        special_tokens: whether ``text`` is tokenized with the tokenizer's special tokens (a
            completion's prompt, as the nodes do), or without (a rendered chat: its template wrote them).

    Raises:
        HTTPException: 404 when no node serves ``model``.
        Unavailable: PostgreSQL could not be read, and never has been (no fleet known yet).
    """
    rows, degraded = await fleet_rows(state)
    if model is not None and not any(r["model"] == model for r in rows):
        raise HTTPException(404, f"model {model!r} is not served by any node")
    tokens: Sequence[int] = token_ids if token_ids is not None else \
        state.tokenizer.encode_compact(text or "", add_special_tokens=special_tokens)
    fleet = state.fleet.view(rows, model)
    # nothing is kept across requests: a prompt is hashed once per size, for this decision
    hashed = {b: prompt_hash_heads(tokens, b, lora_id=lora_id, cache_salt=salt) for b in fleet.sizes}
    return Prompt(tokens, hashed, fleet, degraded)


async def route(state: RouterState, token_ids: Sequence[int] | None, text: str | None, lora_id: int | None,
                salt: str | None, model: str | None, *, special_tokens: bool = True,
                key_node: str | None = None) -> Routed:
    """Decide where a prompt goes (arguments as :func:`prepare`), count it and format the answer.

    ``key_node``: the node of the request's ``prompt_cache_key`` (``routing_api.cache_keys``),
    credited as if it held all of the prompt's full blocks.

    ``decision_ms`` covers it all: the nodes' read, tokenizing, hashing, the query, scoring.

    Raises:
        HTTPException: 404 when no node serves ``model``.
        Unavailable: no fleet known yet.
    """
    t0 = time.perf_counter()
    prompt = await prepare(state, token_ids, text, lora_id, salt, model, special_tokens=special_tokens)
    fleet = prompt.fleet
    matches: Mapping[NodeId, PrefixMatch] = {}  # none when degraded: load alone
    if not prompt.degraded and prompt.hashed:
        try:  # one round trip, whatever the number of sizes
            matches = fleet.own_size_matches(await state.reader.prefix_matches_by_size(prompt.hashed))
        except DatabaseUnavailable:
            prompt.degraded = True  # the query failed: degraded as well
    credit = 0
    keyed = next((v.node_id for v in fleet.views if v.node_id == key_node), None)
    if keyed is not None:
        seen = matches.get(keyed, NO_MATCH)
        if prompt.blocks > seen.gpu + seen.host:
            credit = prompt.blocks
            matches = {**matches, keyed: PrefixMatch(gpu=credit - seen.host, host=seen.host)}
    views = overlay(fleet.views, state.suspect_until, state.inflight, time.monotonic(), state.finished,
                    state.work, state.weights.work_tau_s)
    decision = decide(prompt.blocks, views, matches, state.weights, state.rng, block_size=fleet.block_size,
                      tokens=len(prompt.tokens))
    now = time.monotonic()
    if gate(decision, state.prefill, state.weights, state.settings.prefill_tokens_per_s, fleet.block_size,
            now) is not None:
        state.metrics.bound_gate.inc()
    warm = None
    if state.hubs.fanout > 0 and not prompt.degraded:
        heads = prompt.hashes
        stayed, warm = after_gate(state.hubs, decision, [heads[i:i + 8] for i in range(0, len(heads), 8)],
                                  state.prefill, now, fleet.block_size)
        if stayed is not None:
            state.metrics.hub_stay.inc()
    if guard(decision, state.prefill, state.tail, state.weights, state.settings.prefill_tokens_per_s,
             fleet.block_size, now) is not None:
        state.metrics.tail_guard.inc()
    if prompt.degraded:
        _degrade(state, decision)
    elapsed = time.perf_counter() - t0
    body = decision_body(decision, len(prompt.tokens), prompt.blocks, fleet.block_size, elapsed,
                         degraded=prompt.degraded, gone_nodes=fleet.gone)
    if key_node is not None:
        body["prompt_cache_key"] = {"node_id": key_node, "credit_blocks": credit}
    if warm is not None:
        body["warmup"] = {"node_id": warm.target.node_id, "blocks": warm.blocks,
                          "tokens": warm.blocks * fleet.block_size, "work_blocks": warm.work}
    recent = state.record_decision(decision, body["prompt_blocks"], len(prompt.tokens), body["matched_tokens"],
                                   elapsed)
    return Routed(decision, body, body["prompt_blocks"], prompt, recent, warm)


def _degrade(state: RouterState, decision: Decision) -> None:
    """Say that a decision was made without PostgreSQL, and count it."""
    state.metrics.degraded.inc()
    decision.reason = f"{DEGRADED}; {decision.reason}"
    if decision.chosen is not None:
        decision.chosen.reason = decision.reason
