"""The tail guard: each node's prefill queue as the router sees it, and the rule that keeps a request
out of a queue that would put its time to first token in the fleet's tail.

The cost (:func:`routing_api.scoring.decide`) weighs a node's cached prefix against its load in
hand, requests until their last token; it does not see which node is prefilling *now*. Where
prompts are mostly computed anyway (low reuse), that leaves a request queued behind a long prefill
on the node the cost chose while another node is idle, and those waits make the TTFT tail. Counting
the queue in the cost for every request (a queue weight) buys that tail with hit rate where queues
are long and prefixes long (docs/router.md, "What it does not solve"). The guard acts on the tail
only:

* **The queue.** Per node, the prefills this router sent and has not seen answer
  (:class:`PrefillQueue`): their uncached blocks, in the order sent, and an estimate of when the node
  is done with them, at the node's prefill rate — learned from the first tokens the router sees
  (its streams' first chunks; a response that is not streamed leaves the queue when it arrives,
  and measures nothing). A request's
  *predicted TTFT* on a node is that wait plus its own uncached blocks at the node's rate.
* **The tail.** :class:`TtftTail` keeps the predicted TTFT of the cost's recent choices — in
  prefill tokens of the chosen node (the prediction over its rate per token), so that the rates
  the router has not learned yet do not shift it — and their ``ttft_quantile`` (e.g. 0.9).
* **The rule** (:func:`guard`). When the cost's choice has a queue and its predicted TTFT is above
  that quantile, the request goes instead to the node where it would get its first token soonest,
  among those the bounds allow (not busy, within the load and work bounds) whose cached prefix is
  within ``ttft_tolerance`` × the prompt of the choice's, and whose prefill work lately, this
  request's included, is at most ``ttft_work_slack`` × the choice's — if one is sooner by more
  than the prefill the move gives up (:func:`_given_up`: the prompt's tokens the choice holds and
  that node does not, computed again there). A move that saves the request less time than it adds
  to the fleet's prefill work is no gain: those tokens delay whatever queues behind them.

So at most the tail's share of the requests (1 − the quantile) moves, each at a bounded loss of
cached prefix: where queues are short (the cost's choice idle or soon free) nothing changes.

Before the guard, two rules that let the queues decide what the bounds and the cost cannot see
(:func:`gate`; docs/router.md, "The bound gate and the queue tiebreak"):

* **The bound gate** (``bound_gate``, a ratio): the load and work bounds keep a node that holds a
  prompt from taking it when the node is over the fleet's mean; that is right when its queue
  makes the request wait, and costs hit rate and time when it does not. When the node the cost
  alone would choose is over a bound, and its predicted TTFT is at most ``bound_gate`` × the
  bounded choice's, it takes the request anyway: the imbalance costs this request no time.
* **The queue tiebreak** (``queue_tiebreak``): when the choice is queued, a node holding at least
  as much of the prompt (within the bounds, not busy) where it would start sooner takes it.

Pure apart from the clock values it is given (``now``, monotonic seconds): the router and the
simulator (:class:`kvflow.sim.cluster.RouterPolicy`) run the same code.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field

from eventbus.protocol import NodeId
from routing_api.scoring import Candidate, Decision, RoutingWeights

#: The learning rate of a node's prefill rate: what first tokens measure, averaged (the first
#: ``1 / RATE_LEARNING`` of them equally), then an exponential moving average at this rate.
RATE_LEARNING = 0.1
#: A first token's measurement is clamped to this factor of the estimate either way (an outlier:
#: a node that batched, paused, or served other routers' requests first).
RATE_CLAMP = 4.0
#: The predictions the tail is the quantile of (docs/research/2026-12-router-tail-guard.md: 2,000 kept every
#: goal of the routing study, 1,000 did not).
WINDOW = 2000


@dataclass
class PrefillQueue:
    """The prefills a router sent one node and has not seen answer, oldest first."""

    #: The node's prefill time per block (seconds; in the node's blocks), learned from first tokens.
    s_per_block: float
    #: request key -> (its uncached blocks, when it was sent)
    pending: collections.OrderedDict[int, tuple[int, float]] = field(default_factory=collections.OrderedDict)
    blocks: int = 0
    #: when the node is done with every pending prefill, as estimated (monotonic seconds)
    busy_until: float = 0.0
    #: when the node began the oldest pending prefill: the previous one's first token, or its arrival
    head_since: float = 0.0
    #: first tokens that measured the rate
    measured: int = 0

    def add(self, key: int, blocks: int, now: float) -> None:
        """A request of ``blocks`` uncached blocks is sent to the node."""
        if not self.pending:
            self.head_since = now
        self.pending[key] = (blocks, now)
        self.blocks += blocks
        self.busy_until = max(self.busy_until, now) + blocks * self.s_per_block

    def first_token(self, key: int, now: float, learn: bool = True) -> None:
        """The request ``key`` answered (its first token): its prefill is done, and, if it was the
        oldest and ``learn`` (a stream's first chunk, not a whole response: that time includes the
        decoding), its time since the node began it measures the node's rate."""
        item = self.pending.get(key)
        if item is None:
            return
        blocks, sent = item
        head = next(iter(self.pending)) == key
        del self.pending[key]
        self.blocks -= blocks
        if head and blocks > 0 and learn:
            measured = (now - max(sent, self.head_since)) / blocks
            lo, hi = self.s_per_block / RATE_CLAMP, self.s_per_block * RATE_CLAMP
            self.measured += 1  # the mean of the first measurements, then a moving average
            step = max(RATE_LEARNING, 1.0 / self.measured)
            self.s_per_block += step * (min(hi, max(lo, measured)) - self.s_per_block)
        if head:
            self.head_since = now
        self.busy_until = now + self.blocks * self.s_per_block

    def cancel(self, key: int) -> None:
        """The request ``key`` ended without an answer (refused, failed): it is no longer queued."""
        item = self.pending.pop(key, None)
        if item is not None:
            self.blocks -= item[0]
            self.busy_until -= item[0] * self.s_per_block

    def wait(self, now: float) -> float:
        """How long a request sent now would wait for the node's pending prefills (seconds)."""
        return self.busy_until - now if self.pending and self.busy_until > now else 0.0

    def describe(self, now: float) -> dict[str, float | int]:
        """What the router knows of the node's prefills (``GET /v1/stats``)."""
        return {"pending": len(self.pending), "pending_blocks": self.blocks, "wait_s": round(self.wait(now), 4),
                "s_per_block": round(self.s_per_block, 6), "measured": self.measured}


class TtftTail:
    """The ``quantile`` of the predicted TTFT of the last ``window`` choices, recomputed every
    ``every`` observations (infinite until ``every`` are in)."""

    def __init__(self, quantile: float, window: int = WINDOW, every: int = 50) -> None:
        self.quantile, self.every = quantile, every
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.threshold = float("inf")
        self._since = 0

    def describe(self) -> dict[str, float | int | None]:
        return {"quantile": self.quantile, "observed": len(self.recent),
                "threshold_tokens": None if self.threshold == float("inf") else round(self.threshold, 1)}

    def observe(self, predicted: float) -> None:
        self.recent.append(predicted)
        self._since += 1
        if self._since >= self.every:
            self._since = 0
            s = sorted(self.recent)
            self.threshold = s[int(self.quantile * (len(s) - 1))]


def _s_per_block(c: Candidate, queues: Mapping[NodeId, PrefillQueue], tokens_per_s: float, block_size: int) -> float:
    """The node's prefill time per block: learned, else ``tokens_per_s`` at its block size (else ``block_size``)."""
    q = queues.get(c.node_id)
    return q.s_per_block if q is not None else (c.block_size or block_size or 16) / tokens_per_s


def predicted_ttft(c: Candidate, queues: Mapping[NodeId, PrefillQueue], tokens_per_s: float, block_size: int,
                   now: float) -> float:
    """Its wait for the node's pending prefills plus its own uncached blocks at the node's rate (seconds)."""
    q = queues.get(c.node_id)
    wait = q.wait(now) if q is not None else 0.0
    return wait + max(0, c.prompt_blocks - c.matched_blocks) * _s_per_block(c, queues, tokens_per_s, block_size)


def _cached_share(c: Candidate) -> float:
    """The share of the prompt the node holds (nodes of any block size compare)."""
    return c.matched_blocks / c.prompt_blocks if c.prompt_blocks else 0.0


def _given_up(chosen: Candidate, c: Candidate, queues: Mapping[NodeId, PrefillQueue], tokens_per_s: float,
              block_size: int) -> float:
    """The prefill time a move from ``chosen`` to ``c`` adds to the fleet: the prompt's tokens the
    choice holds and ``c`` does not, computed again at ``c``'s rate (seconds; 0 when ``c`` holds as much)."""
    lost = max(0.0, _cached_share(chosen) - _cached_share(c)) * c.prompt_blocks
    return lost * _s_per_block(c, queues, tokens_per_s, block_size)


def guard(decision: Decision, queues: Mapping[NodeId, PrefillQueue], tail: TtftTail, w: RoutingWeights,
          tokens_per_s: float, block_size: int, now: float) -> Candidate | None:
    """Apply the tail guard to ``decision`` (module docstring): returns the node it sends the request
    to instead (``decision.chosen`` and its ``reason`` updated), or None when the cost's choice
    stands. ``tokens_per_s``: the prefill rate of a node not measured yet; ``block_size``: the
    decision's (a candidate's own, when it has one). Off when ``w.ttft_quantile`` is 0."""
    chosen = decision.chosen
    if chosen is None or w.ttft_quantile <= 0:
        return None
    mine = predicted_ttft(chosen, queues, tokens_per_s, block_size, now)
    # the tail in the node's prefill tokens (the prediction over its rate per token): what the
    # router has not measured yet (its first rates) does not shift it
    tokens = mine * (chosen.block_size or block_size or 16) / _s_per_block(chosen, queues, tokens_per_s, block_size)
    threshold = tail.threshold
    tail.observe(tokens)
    q = queues.get(chosen.node_id)
    if q is None or q.wait(now) <= 0 or tokens <= threshold:
        return None
    floor = _cached_share(chosen) - w.ttft_tolerance
    work_cap = w.ttft_work_slack * (chosen.work + chosen.prefill_blocks)
    best, best_t = chosen, mine
    for c in decision.candidates:
        if c is chosen or not c.eligible or c.busy or c.over_bound or _cached_share(c) < floor \
                or c.work + c.prefill_blocks > work_cap:
            continue
        t = predicted_ttft(c, queues, tokens_per_s, block_size, now)
        if t < best_t and mine - t > _given_up(chosen, c, queues, tokens_per_s, block_size):
            best, best_t = c, t
    if best is chosen:
        return None
    best.reason = (f"tail guard: predicted TTFT {mine:.2f} s on {chosen.node_id} (queued; {tokens:.0f} tokens of "
                   f"prefill) is above the recent p{w.ttft_quantile * 100:g} ({threshold:.0f}); {best_t:.2f} s "
                   f"here, {best.matched_blocks}/{best.prompt_blocks} prompt blocks cached (cost's choice: "
                   f"{chosen.reason})")
    decision.chosen = best
    decision.reason = best.reason
    return best


def free_candidates(decision: Decision) -> list[Candidate]:
    """The decision's candidates that may take the request whatever the bounds say: eligible, not busy."""
    return [c for c in decision.candidates if c.eligible and not c.busy]


def cost_choice(free: list[Candidate]) -> Candidate:
    """The node the cost alone would choose among ``free`` (not empty), the bounds aside."""
    return min(free, key=lambda c: (c.cost, c.decode_blocks, c.node_id))


def gate(decision: Decision, queues: Mapping[NodeId, PrefillQueue], w: RoutingWeights, tokens_per_s: float,
         block_size: int, now: float) -> Candidate | None:
    """The bound gate and the queue tiebreak (module docstring), applied to ``decision`` before the tail
    guard. Returns the node it sends the request to instead (``decision.chosen`` and its ``reason``
    updated), or None when the choice stands. Each is off when its weight is (``bound_gate`` 0,
    ``queue_tiebreak`` false)."""
    chosen = decision.chosen
    if chosen is None:
        return None
    free = free_candidates(decision)
    moved: Candidate | None = None
    if w.bound_gate > 0 and len(free) > 1:
        pure = cost_choice(free)
        if pure is not chosen and pure.over_bound:
            mine = predicted_ttft(chosen, queues, tokens_per_s, block_size, now)
            theirs = predicted_ttft(pure, queues, tokens_per_s, block_size, now)
            if theirs <= w.bound_gate * mine:
                pure.reason = (f"bound gate: over the bound, but predicted TTFT {theirs:.2f} s here against "
                               f"{mine:.2f} s on {chosen.node_id}, the bounded choice ({chosen.reason})")
                moved = chosen = pure
    q = queues.get(chosen.node_id)
    if w.queue_tiebreak and q is not None and q.wait(now) > 0:
        mine = predicted_ttft(chosen, queues, tokens_per_s, block_size, now)
        best, best_t = chosen, mine
        for c in free:
            if c is chosen or c.over_bound or c.prefill_blocks > chosen.prefill_blocks:
                continue
            t = predicted_ttft(c, queues, tokens_per_s, block_size, now)
            if t < best_t:
                best, best_t = c, t
        if best is not chosen:
            best.reason = (f"queue tiebreak: {chosen.node_id} holds no more of the prompt and is queued "
                           f"(predicted TTFT {mine:.2f} s); {best_t:.2f} s here ({chosen.reason})")
            moved = chosen = best
    if moved is not None:
        decision.chosen = moved
        decision.reason = moved.reason
    return moved
