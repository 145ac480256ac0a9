"""Traces built to defeat the adaptive eviction policy's guard (issue 41's eviction floor), and the
windowed comparison with LRU that the floor is judged by.

The adaptive policy (:mod:`inference_node.kv.adaptive`) learns which blocks to keep: a frequency
band for reused blocks and a junk band for classes of blocks that are rarely reused. Each can be
wrong on traffic whose statistics turn around, and the guard must notice before the loss adds up.
Each trace here turns them around on purpose, again and again, at the speed that hurts most:

* :func:`junk_trap`: one-off short prompts teach the policy that short prompts are junk; then the
  short prompts come back twice, soon enough for LRU to hit them, while long prompts that return
  only after the cache has forgotten them fill it. A junk band evicts the short prompts first.
* :func:`frequency_trap`: a hot set reused many times fills the frequency band, then goes cold,
  while a new working set is reused once each at a distance LRU still hits. The frequency band
  keeps the cold set.

Both alternate their phases (``period`` requests each), so that a guard that switches back after a
phase pays again. :func:`windowed_deficit` replays a trace through LRU and through the policy and
reports the worst loss over any window of ``window`` requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.manager import KVCacheManager
from inference_node.kv.prompt import Prompt
from kvflow.sim.families import _Keys
from kvflow.sim.request import BLOCK_TOKENS, SimRequest
from kvflow.traces import TraceRequest, replay_core


def junk_trap(n: int = 8000, seed: int = 21, capacity: int = 1000, period: int = 1000) -> list[SimRequest]:
    """Phases of ``period`` requests, alternating (one request a second):

    * **teach**: one-off prompts of 2 blocks (never seen again: their class looks like junk),
      interleaved with long prompts (12 blocks) from a pool that returns each only after about 4 ×
      ``capacity`` blocks (LRU never hits them; the policy's ghosts see them return, so their
      class stays worth keeping);
    * **trap**: the same long prompts, and short prompts of 2 blocks each asked three times, the
      repeats about ``capacity / 4`` blocks apart: LRU hits every repeat; a policy that still
      stores short prompts in the junk band evicts them before the long ones and misses.
    """
    rng = random.Random(seed)
    keys = _Keys(1 << 44)
    long_pool = [keys.fresh(12) for _ in range(max(8, 4 * capacity // 12 // 2))]
    out: list[SimRequest] = []
    pending: list[tuple[int, list[int]]] = []  # (due request index, short prompt) repeats
    li = 0
    gap = max(1, capacity // 4 // 7)  # requests between repeats: ~capacity / 4 blocks at ~7 blocks each
    for i in range(n):
        trap = (i // period) % 2 == 1
        if i % 2 == 0:
            prompt = long_pool[li % len(long_pool)]
            li += 1
        elif trap:
            if pending and pending[0][0] <= i:
                _, prompt = pending.pop(0)
            else:
                prompt = keys.fresh(2)
                pending.append((i + gap, prompt))
                pending.append((i + 2 * gap, prompt))
                pending.sort(key=lambda x: x[0])
        else:
            pending.clear()
            prompt = keys.fresh(2)
        out.append(SimRequest(float(i), tuple(prompt), rng.randint(20, 200)))
    return out


def frequency_trap(n: int = 8000, seed: int = 22, capacity: int = 1000, period: int = 1000) -> list[SimRequest]:
    """Phases of ``period`` requests, alternating (one request a second):

    * **hot**: a set of ``capacity / 2`` blocks in prompts of 4, each reused many times (the
      frequency band fills with it), with one-off prompts of 4 blocks between;
    * **shift**: that set goes cold for good (the next hot phase has a new one); new prompts of 4
      blocks are each asked twice, about ``capacity / 2`` blocks apart: LRU hits the second; a
      frequency band still holding the cold set leaves them too little room.
    """
    rng = random.Random(seed)
    keys = _Keys(1 << 44)
    out: list[SimRequest] = []
    hot: list[list[int]] = []
    pending: list[tuple[int, list[int]]] = []
    gap = max(1, capacity // 2 // 4)
    for i in range(n):
        phase = i // period
        if phase % 2 == 0:
            if i % period == 0:
                hot = [keys.fresh(4) for _ in range(max(1, capacity // 2 // 4))]
            prompt = rng.choice(hot) if i % 2 == 0 else keys.fresh(4)
        else:
            if pending and pending[0][0] <= i:
                _, prompt = pending.pop(0)
            else:
                prompt = keys.fresh(4)
                pending.append((i + gap, prompt))
        out.append(SimRequest(float(i), tuple(prompt), rng.randint(20, 200)))
    return out


#: The adversarial traces by name.
ADVERSARIAL = {"junk_trap": junk_trap, "frequency_trap": frequency_trap}


def replay_hits(requests: Sequence[SimRequest], capacity: int, adaptive: AdaptivePolicy | None,
                observe: Callable[[int, KVCacheManager], None] | None = None) -> list[int]:
    """Each request's cached prefix, in blocks, replayed through one cache of ``capacity`` blocks
    (LRU when ``adaptive`` is None) by ``kvflow.traces.replay_core``. ``observe(i, manager)`` is
    called after each request's allocation."""
    trace = [TraceRequest(r.t, len(r.keys) * BLOCK_TOKENS, r.output_tokens, r.keys) for r in requests]
    prompts = [Prompt.from_block_keys(r.keys, BLOCK_TOKENS) for r in requests]
    hits: list[int] = []
    replay_core(trace, prompts, capacity, block_size=BLOCK_TOKENS, adaptive=adaptive, per_request=hits,
                observe=observe)
    return hits


@dataclass(frozen=True)
class Deficit:
    """The policy against LRU on one trace: totals, and the worst window."""

    lru_hits: int
    hits: int
    blocks: int
    #: the most LRU's hits exceed the policy's over any ``window`` consecutive requests
    worst_window_deficit: int
    #: the blocks requested in that window
    worst_window_blocks: int
    window: int

    @property
    def ratio(self) -> float:
        return self.hits / self.lru_hits if self.lru_hits else 1.0


def _worst_window(lru: Sequence[int], hits: Sequence[int], window: int) -> tuple[int, int]:
    """The most LRU's hits exceed ``hits`` over any ``window`` consecutive requests, and where
    that window starts (the first such)."""
    diff = [a - b for a, b in zip(lru, hits, strict=True)]
    cur = best = sum(diff[:window])
    start = 0
    for i in range(window, len(diff)):
        cur += diff[i] - diff[i - window]
        if cur > best:
            best, start = cur, i - window + 1
    return best, start


def windowed_deficit(requests: Sequence[SimRequest], capacity: int, policy: AdaptivePolicy,
                     window: int) -> Deficit:
    """Replay ``requests`` through LRU and through ``policy`` at ``capacity`` blocks: the totals and
    the worst window of ``window`` requests (LRU's hits minus the policy's)."""
    lru = replay_hits(requests, capacity, None)
    ours = replay_hits(requests, capacity, policy)
    sizes = [len(r.keys) for r in requests]
    worst, start = _worst_window(lru, ours, window)
    worst_blocks = sum(sizes[start:start + window])
    return Deficit(sum(lru), sum(ours), sum(sizes), worst, worst_blocks, window)


@dataclass
class FloorRun:
    """A replay through the adaptive policy with its floor (:mod:`inference_node.kv.floor`): each
    request's hits, and where the floor engaged and let go."""

    hits: list[int]
    #: Requests at whose lookup the floor engaged (the cache became plain LRU), and let go.
    engaged_at: list[int] = field(default_factory=list)
    released_at: list[int] = field(default_factory=list)
    #: At each engagement, the LRU shadow's blocks the cache did not hold (the most it can cost).
    missing: list[int] = field(default_factory=list)

    @property
    def switches(self) -> int:
        return len(self.engaged_at)

    @property
    def episodes(self) -> int:
        """Stretches the policy ran: from the start, and after each time the floor let go."""
        return 1 + len(self.released_at)

    @property
    def missing_total(self) -> int:
        return sum(self.missing)

    def worst_window_excess(self, lru: Sequence[int], window: int, policy: AdaptivePolicy, theta: float,
                            biggest: int) -> float:
        """The most that any ``window`` requests' loss against LRU (``lru``: its hits per
        request) exceeds the floor's bound for that window: ``floor_share`` x LRU's hits in it,
        ``theta`` (the floor's blocks) + ``biggest`` (one prompt) for each stretch of the policy that touches it,
        and the missing blocks of each engagement whose stretch of LRU touches it. At most 0
        when the bound holds."""
        n = len(self.hits)
        runs = list(zip([0, *self.released_at], [*self.engaged_at, n - 1], strict=False))
        floors = list(zip(self.engaged_at, [*self.released_at, n - 1], self.missing, strict=False))
        worst = float("-inf")
        for s in range(max(1, n - window + 1)):
            e = min(n, s + window) - 1
            loss = sum(lru[s:e + 1]) - sum(self.hits[s:e + 1])
            bound = policy.floor_share * sum(lru[s:e + 1])
            bound += sum(theta + biggest for a, b in runs if a <= e and b >= s)
            bound += sum(m for a, b, m in floors if a <= e and b >= s)
            worst = max(worst, loss - bound)
        return worst


def replay_floor(requests: Sequence[SimRequest], capacity: int, policy: AdaptivePolicy) -> FloorRun:
    """:func:`replay_hits` through ``policy`` (its floor on), recording the floor's switches."""
    run = FloorRun([])
    state = {"engaged": False}

    def observe(i: int, mgr: KVCacheManager) -> None:
        learner = mgr.adaptive
        floor = learner.floor if learner is not None else None
        if floor is None or floor.engaged == state["engaged"]:
            return
        state["engaged"] = floor.engaged
        if floor.engaged:
            run.engaged_at.append(i)
            run.missing.append(floor.missing)
        else:
            run.released_at.append(i)

    run.hits = replay_hits(requests, capacity, policy, observe)
    return run


def floor_report(n: int = 8000, capacities: Sequence[int] = (200, 1000), window: int = 1000,
                 policy: AdaptivePolicy | None = None) -> dict[str, dict[str, float]]:
    """Each trap at each capacity, with the floor and without: hits against LRU's, the floor's
    switches, the worst window of ``window`` requests, and the bound's worst excess over any
    window (at most 0 when the loss stays within what docs/benchmarks.md ("The floor") argues)."""
    pol = policy or AdaptivePolicy()
    out: dict[str, dict[str, float]] = {}
    for name, gen in ADVERSARIAL.items():
        for cap in capacities:
            reqs = gen(n, capacity=cap)
            lru = replay_hits(reqs, cap, None)
            off = replay_hits(reqs, cap, AdaptivePolicy(floor=False))
            run = replay_floor(reqs, cap, pol)
            theta = min(pol.floor_blocks, pol.floor_caches * cap)
            biggest = max(len(r.keys) for r in reqs)
            lru_total = sum(lru)

            out[f"{name}_{cap}"] = {
                "lru_hits": lru_total, "floor_vs_lru": sum(run.hits) / lru_total if lru_total else 1.0,
                "no_floor_vs_lru": sum(off) / lru_total if lru_total else 1.0,
                "switches": run.switches, "missing_at_switches": run.missing_total,
                "worst_window_deficit": _worst_window(lru, run.hits, window)[0],
                "no_floor_worst_window_deficit": _worst_window(lru, off, window)[0],
                "bound_excess": run.worst_window_excess(lru, window, pol, theta, biggest),
            }
    return out
