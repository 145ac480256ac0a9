"""Hubs: prefixes that many prompts continue, copied ahead of time to the nodes the balance wants.

The load and work bounds (:func:`routing_api.scoring.decide`) move a request off a node that holds
its prefix when that node is over the fleet's mean, and the bound gate (:func:`routing_api.prefill.gate`)
sends it back when the move would cost the request most of its time to first token. Both are about
one request. Two kinds of prefix behave differently under them:

* a **session's own context** (a conversation, an agent task's growing transcript): one prompt
  continues it at a time; moving the session computes the context again, once, and the session's
  later requests follow it;
* a **hub**: a prefix that many different prompts continue (an agent type's tool definitions, a
  system prompt, a few-shot preamble). Every new session that starts with it is drawn to the nodes
  holding it, so where the hub lives decides where new sessions land — and the gate keeps them
  there, because the request at hand would compute the hub again elsewhere.

So with hubs the balance comes best from where sessions *start*: this module copies a hub to a
light, idle node before a session needs it there (a **warm-up**: the hub's tokens sent to that
node as a prefill of one output token), and then leaves sessions where their own context is
when that costs them no wait (**stay**). Both are off when ``RoutingWeights.hub_fanout`` is 0.

* :class:`Hubs` remembers, for each block hash the router has routed, up to ``fanout`` distinct
  next blocks (a bounded memory, least recently seen forgotten first). A prompt's *hub prefix*
  ends at its last block that ``fanout`` or more distinct blocks have followed: a session's context
  has one continuation per block (its own next turn), a hub as many as the sessions that start
  with it.
* :func:`stay` (after the bound gate): when the cost alone would choose a node that is over a
  bound, and that node holds more of the prompt than its hub prefix and more than the bounded
  choice, and has no prefill queue, the request stays there: moving it would compute the
  session's context again, and the imbalance costs this request no wait.
* :func:`warmup`: when the request goes to a node over a bound for a hub prefix it holds (the
  gate sent it back), the hub is copied to the node with the least prefill work lately among
  those within the bounds, without a prefill queue, that hold less of it. The next session that
  starts with the hub finds it there. The copy is real prefill work on that node, counted as
  such (the router's routed work and prefill queue; the simulator's prefill tokens).

Pure: the router (``routing_api.decisions``, ``routing_api.warmups``) and the simulator
(:class:`kvflow.sim.cluster.RouterPolicy`) run the same code. Measured and chosen:
docs/router.md, "Hubs".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from eventbus.protocol import NodeId
from routing_api.prefill import PrefillQueue, cost_choice, free_candidates
from routing_api.scoring import Candidate, Decision

#: Blocks whose continuations :class:`Hubs` remembers (about 150 bytes each with one continuation, the
#: most common: some 40 MB when full; a block with several keeps a set of up to ``fanout``).
HUB_MEMORY = 262_144


class Hubs:
    """The distinct continuations of the blocks routed lately, up to ``fanout`` each."""

    def __init__(self, fanout: int, memory: int = HUB_MEMORY) -> None:
        self.fanout = fanout
        self.memory = memory
        #: block → its one continuation, or the set of its distinct continuations once it has two
        self._next: OrderedDict[Hashable, Hashable | set[Hashable]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def _count(self, block: Hashable) -> int:
        seen = self._next.get(block, _NONE)
        return 0 if seen is _NONE else len(seen) if isinstance(seen, set) else 1

    def observe(self, blocks: Sequence[Hashable]) -> int:
        """Record a prompt's blocks (their hashes, in order) and return its hub prefix in blocks: up to
        and including its last block that ``fanout`` or more distinct blocks have followed (this
        prompt's own next block counted), 0 when none has (or ``fanout`` is 0)."""
        if self.fanout <= 0:
            return 0
        hub = 0
        nexts, fanout = self._next, self.fanout
        for i in range(len(blocks) - 1):
            b, after = blocks[i], blocks[i + 1]
            seen = nexts.get(b, _NONE)
            if seen is _NONE:
                nexts[b] = after  # most blocks only ever have one: kept without a set
                if len(nexts) > self.memory:
                    nexts.popitem(last=False)
                n = 1
            else:
                nexts.move_to_end(b)
                if not isinstance(seen, set):
                    if seen == after:
                        n = 1
                    else:
                        nexts[b] = seen = {seen, after}
                        n = 2
                else:
                    if len(seen) < fanout:
                        seen.add(after)
                    n = len(seen)
            if n >= fanout:
                hub = i + 1
        if blocks and self._count(blocks[-1]) >= fanout:
            hub = len(blocks)  # the prompt is the hub itself (nothing of its own after it)
        return hub


#: an absent entry of :class:`Hubs` (a continuation may be any hashable, None included)
_NONE = object()


def _idle(c: Candidate, queues: Mapping[NodeId, PrefillQueue], now: float) -> bool:
    q = queues.get(c.node_id)
    return q is None or q.wait(now) <= 0


def stay(decision: Decision, hub_blocks: int, queues: Mapping[NodeId, PrefillQueue], now: float) -> Candidate | None:
    """Keep the request on the cost's choice when the bounds moved it off a node that holds its own
    context (more than its hub prefix) and has no prefill queue (module docstring). Returns that
    node (``decision.chosen`` and its ``reason`` updated), or None when the choice stands."""
    chosen = decision.chosen
    if chosen is None or chosen.over_bound:
        return None
    free = free_candidates(decision)
    pure = cost_choice(free) if free else None
    if pure is None or pure is chosen or not pure.over_bound:
        return None
    if pure.matched_blocks <= max(hub_blocks, chosen.matched_blocks) or not _idle(pure, queues, now):
        return None
    pure.reason = (f"stay: over the bound, but holds {pure.matched_blocks} blocks of this prompt ({hub_blocks} of "
                   f"them a shared prefix) and has no prefill queue; the bounded choice was {chosen.node_id} "
                   f"({chosen.reason})")
    decision.chosen = pure
    decision.reason = pure.reason
    return pure


@dataclass(frozen=True, slots=True)
class Warmup:
    """A hub prefix to copy: ``blocks`` of the prompt (the decision's block size) to ``target``, which
    holds ``target.matched_blocks`` of them already."""

    target: Candidate
    blocks: int

    @property
    def work(self) -> int:
        """The blocks the target computes (those it does not hold)."""
        return max(0, self.blocks - self.target.matched_blocks)


def warmup(decision: Decision, hub_blocks: int, queues: Mapping[NodeId, PrefillQueue], now: float,
           block_size: int = 0) -> Warmup | None:
    """The hub copy this decision calls for (module docstring), or None: the chosen node is over a
    bound and holds some of the prompt's hub prefix; the target is the eligible node within the
    bounds, not busy, without a prefill queue, holding less of the hub, with the least work lately
    (then the fewest requests, then the id). The hub is hashed in the decision's ``block_size`` (0:
    every node's): a node of another size holds other blocks, and is neither copied from nor to."""
    chosen = decision.chosen
    if chosen is None or not chosen.over_bound:
        return None
    blocks = min(hub_blocks, chosen.matched_blocks)
    size = chosen.block_size
    if blocks <= 0 or (block_size and size not in (0, block_size)):
        return None
    targets = [c for c in decision.candidates
               if c is not chosen and c.eligible and not c.busy and not c.over_bound and c.matched_blocks < blocks
               and c.block_size == size and _idle(c, queues, now)]
    if not targets:
        return None
    return Warmup(min(targets, key=lambda c: (c.work, c.requests, c.node_id)), blocks)


def after_gate(hubs: Hubs, decision: Decision, blocks: Sequence[Hashable], queues: Mapping[NodeId, PrefillQueue],
               now: float, block_size: int = 0) -> tuple[Candidate | None, Warmup | None]:
    """Hubs' part of a decision, after the bound gate and before the tail guard (the router and the
    simulator both): record the prompt's ``blocks`` in ``hubs``, then :func:`stay` and :func:`warmup`.
    Returns the node the request stayed on (or None) and the copy to send (or None); nothing when
    ``hubs.fanout`` is 0."""
    if hubs.fanout <= 0:
        return None, None
    hub = hubs.observe(blocks)
    return stay(decision, hub, queues, now), warmup(decision, hub, queues, now, block_size)
