"""Adaptive priorities: a cache without client hints that still beats LRU.

When a request brings no retention config, the core asks this policy for each new block's
priority and duration, and, when a block is reused, whether to raise it. The policy *learns from
observed reuse*, online, and speaks only the core's own language (priorities and retention
durations), so its decisions show up in events and SQL like any client's.

How it decides. Every block belongs to a class, from what is known when it is stored or reused:

* a new block: whether its request continued an earlier prompt (a prefix hit beyond the first
  block) or started fresh, its distance from the prompt's end (0, 1, 2–3, 4+ blocks), and the
  prompt's size (≤ 4, ≤ 16, ≤ 64, > 64 blocks); blocks of generated tokens form their own
  classes;
* a reused block: how often it has been reused (1, 2, 3–5, 6+).

For each class the policy counts, as the cache runs, how many of its blocks were reused
(``on_reuse``) and how many were evicted unused (``on_evict``), and how long a reuse took. From
that it estimates the *value density* of a class: the probability of reuse divided by the
expected time to it (hits per block-second of cache). Then

* a class whose reuse probability is below ``junk_probability`` (e.g. a prompt's last block,
  which a later turn almost never shares) gets ``junk_priority`` and no duration: evicted first;
* every other class is ranked by value density and mapped onto priorities
  ``min_priority``..``max_priority`` (all above the default 35), with a retention duration of
  ``duration_factor`` × the class's typical time to reuse. A block that is not reused by then
  falls back to 35, where plain LRU takes over.

So blocks likely to be reused soon are protected for as long as a reuse is plausible, blocks
unlikely to be reused go first, and protection always ends: stale blocks cannot squat. Until a
class has ``min_samples`` observations, its estimate leans on a prior (``prior_probability``,
``prior_gap_s``). The policy only ever *raises* a reused block (a pinned system prompt at 100
stays where the client put it).

Deterministic: the same sequence of calls gives the same decisions (the core calls it from its
own single thread).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from eventbus.protocol import DEFAULT_PRIORITY

#: Class ids: 0..31 new prompt blocks, 64..67 decode blocks, 68..71 reused blocks (32..63 unused).
_DIST = (0, 1, 2, 2, 3)  # distance from the prompt's end -> bucket (4+ -> 3)
_REUSE_CLASSES = 4
_DECODE_BASE = 64
_REUSED_BASE = 68
NUM_CLASSES = _REUSED_BASE + _REUSE_CLASSES


def _size_bucket(n_blocks: int) -> int:
    return 0 if n_blocks <= 4 else 1 if n_blocks <= 16 else 2 if n_blocks <= 64 else 3


def _reuse_bucket(hits: int) -> int:
    return 0 if hits <= 1 else 1 if hits == 2 else 2 if hits <= 5 else 3


@dataclass(frozen=True, slots=True)
class BlockContext:
    """What the core knows about a block when it is stored."""

    index: int  # position in the sequence (0 = first block)
    prompt_blocks: int  # full blocks of the prompt
    matched_blocks: int  # prompt blocks the request found cached
    is_decode: bool  # holds generated tokens only


@dataclass
class _ClassStats:
    reused: float = 0.0
    evicted: float = 0.0
    gap_sum: float = 0.0


@dataclass(frozen=True)
class AdaptivePolicy:
    """The adaptive policy's settings (see the module docstring); what it learns lives in an
    :class:`AdaptiveLearner`, one per cache."""

    junk_probability: float = 0.04
    junk_priority: int = 5
    min_priority: int = 40
    max_priority: int = 90
    duration_factor: float = 2.0
    prior_probability: float = 0.25
    prior_gap_s: float = 120.0
    min_samples: float = 20.0
    #: Exponential forgetting of old observations (1.0 = keep all), per observation of a class.
    decay: float = 0.99
    #: Evicted blocks remembered (digest -> class, idle time at eviction, eviction time), so that a
    #: later miss on one counts as the reuse it would have been. Without them a class that is
    #: evicted early could never prove its worth. Sized in blocks; 0 = 4 x the cache.
    ghost_capacity: int = 0
    #: A shadow LRU cache of the same size (digests only) measures what plain LRU would have hit;
    #: every ``window`` prompt blocks, protection is strengthened if it beat LRU and weakened if
    #: not, so the policy backs off to LRU where its predictions do not pay. 0 = the cache's size.
    shadow_capacity: int = 0
    window: int = 2000
    strength_step: float = 0.1
    down_factor: float = 2.0

    def __post_init__(self) -> None:
        for name in ("junk_priority", "min_priority", "max_priority"):
            v = getattr(self, name)
            if not 0 <= v <= 100:
                raise ValueError(f"{name} must be within 0..100, got {v}")
        if not self.min_priority <= self.max_priority:
            raise ValueError("min_priority must not exceed max_priority")
        if not 0 < self.decay <= 1:
            raise ValueError("decay must be within (0, 1]")


class AdaptiveLearner:
    """What the adaptive policy learns on one cache of ``cache_blocks`` blocks (both tiers), and
    the core's hooks into it. Its state is bounded: per-class counters, the ghosts
    (``ghost_capacity``) and the shadow LRU (``shadow_capacity``)."""

    def __init__(self, policy: AdaptivePolicy, cache_blocks: int) -> None:
        self.policy = policy
        self.ghost_capacity = policy.ghost_capacity or 4 * cache_blocks
        self.shadow_capacity = policy.shadow_capacity or cache_blocks
        self._stats = [_ClassStats() for _ in range(NUM_CLASSES)]
        self._ghosts: OrderedDict[bytes, tuple[int, float, float]] = OrderedDict()
        self._shadow: OrderedDict[bytes, None] = OrderedDict()
        self._strength = 1.0
        self._window_actual = 0
        self._window_shadow = 0
        self._window_seen = 0
        self._ranks: list[tuple[int, float | None]] | None = None
        self._dirty = 0

    # ---------------------------------------------------------------- estimates

    def probability(self, cls: int) -> float:
        s = self._stats[cls]
        w = self.policy.min_samples
        return (s.reused + w * self.policy.prior_probability) / (s.reused + s.evicted + w)

    def mean_gap_s(self, cls: int) -> float:
        s = self._stats[cls]
        w = self.policy.min_samples * 0.25
        return (s.gap_sum + w * self.policy.prior_gap_s) / (s.reused + w)

    def _table(self) -> list[tuple[int, float | None]]:
        """(priority, duration) per class, recomputed after every 64 observations."""
        if self._ranks is not None and self._dirty < 64:
            return self._ranks
        dens = []
        for c in range(NUM_CLASSES):
            p = self.probability(c)
            dens.append((p / max(self.mean_gap_s(c), 1e-3), c, p))
        useful = sorted((d, c) for d, c, p in dens if p >= self.policy.junk_probability)
        table: list[tuple[int, float | None]] = [(self.policy.junk_priority, None)] * NUM_CLASSES
        s = self._strength
        lo = DEFAULT_PRIORITY + s * (self.policy.min_priority - DEFAULT_PRIORITY)
        span = s * (self.policy.max_priority - self.policy.min_priority)
        for rank, (_, c) in enumerate(useful):
            prio = round(lo + (span * rank / (len(useful) - 1) if len(useful) > 1 else span))
            duration = s * self.policy.duration_factor * self.mean_gap_s(c)
            table[c] = (prio, duration if prio != DEFAULT_PRIORITY else None)
        self._ranks, self._dirty = table, 0
        return table

    def _observe(self, cls: int, reused: bool, gap_s: float = 0.0) -> None:
        s = self._stats[cls]
        decay = self.policy.decay
        if decay < 1.0:
            s.reused *= decay
            s.evicted *= decay
            s.gap_sum *= decay
        if reused:
            s.reused += 1
            s.gap_sum += gap_s
        else:
            s.evicted += 1
        self._dirty += 1

    # ---------------------------------------------------------------- the core's hooks

    def new_block(self, ctx: BlockContext) -> tuple[int, float | None, int]:
        """Priority, duration and class of a new block."""
        if ctx.is_decode:
            cls = _DECODE_BASE + _size_bucket(ctx.prompt_blocks)
        else:
            dist = ctx.prompt_blocks - 1 - ctx.index
            cls = (16 if ctx.matched_blocks > 1 else 0) + _DIST[min(dist, 4)] * 4 + _size_bucket(ctx.prompt_blocks)
        prio, dur = self._table()[cls]
        return prio, dur, cls

    def on_reuse(self, cls: int, priority: int, hits: int, gap_s: float) -> tuple[int, float | None, int] | None:
        """A cached block of class ``cls`` is reused (``hits``: earlier reuses, ``gap_s``: idle time).

        Returns the raised priority, duration and new class, or None to leave the block alone.
        """
        if 0 <= cls < NUM_CLASSES:
            self._observe(cls, True, gap_s)
        new_cls = _REUSED_BASE + _reuse_bucket(hits + 1)
        prio, dur = self._table()[new_cls]
        if prio < priority:
            return None
        return prio, dur, new_cls

    def on_evict(self, digest: bytes, cls: int, idle_s: float, now: float) -> None:
        """A block of class ``cls`` left the cache after ``idle_s`` unused: remember it as a ghost."""
        if not 0 <= cls < NUM_CLASSES:
            return
        ghosts = self._ghosts
        ghosts[digest] = (cls, idle_s, now)
        while len(ghosts) > self.ghost_capacity:
            _, (old_cls, _, _) = ghosts.popitem(last=False)
            self._observe(old_cls, False)  # never asked for again while remembered: not reused

    def on_lookup(self, digests: Sequence[bytes], matched: int, now: float) -> None:
        """A prompt was looked up: ``matched`` of its blocks were cached.

        Misses on ghosts count as the reuses they would have been; the shadow LRU replays the
        same lookup, and the comparison tunes the strength of protection.
        """
        ghosts = self._ghosts
        if ghosts:
            for d in digests[matched:]:
                ghost = ghosts.pop(d, None)
                if ghost is not None:
                    cls, idle_s, evicted_at = ghost
                    self._observe(cls, True, idle_s + (now - evicted_at))
        shadow = self._shadow
        shadow_hits = 0
        for d in digests:
            if d not in shadow:
                break
            shadow_hits += 1
        for d in digests:
            shadow[d] = None
            shadow.move_to_end(d)
        while len(shadow) > self.shadow_capacity:
            shadow.popitem(last=False)
        self._window_actual += matched
        self._window_shadow += shadow_hits
        self._window_seen += len(digests)
        if self._window_seen >= self.policy.window:
            if self._window_actual < self._window_shadow:
                self._strength = max(0.0, self._strength - self.policy.strength_step * self.policy.down_factor)
            elif self._window_actual > self._window_shadow:
                self._strength = min(1.0, self._strength + self.policy.strength_step)
            self._window_actual = self._window_shadow = self._window_seen = 0
            self._ranks = None

    def describe(self) -> dict[str, object]:
        """The learned state, for the node's stats endpoint and the benchmarks."""
        classes = []
        for c, (priority, duration) in enumerate(self._table()):
            s = self._stats[c]
            if s.reused + s.evicted == 0:
                continue
            classes.append({"class": c, "probability": round(self.probability(c), 4),
                            "mean_gap_s": round(self.mean_gap_s(c), 2), "priority": priority,
                            "duration_s": None if duration is None else round(duration, 2)})
        return {"strength": round(self._strength, 2), "classes": classes}
