"""Adaptive priorities: a cache without client hints that learns, online, what its traffic reuses.

When a request brings no retention config, the core asks this policy for each new block's
priority and retention duration, and, when a block is reused, whether to raise it. The policy
speaks only the core's own language (priorities and durations, which show up in events and SQL
like any client's; eviction stays "lowest priority first, least recently used first, leaves
only"), and a client's explicit retention config always wins: the policy is never asked then.

**Classes.** Every block belongs to a class, from what is known when it is stored or reused:

* a new prompt block: whether its request continued an earlier prompt (a prefix hit beyond the
  first block) or started fresh, its distance from the prompt's end (0, 1, 2–3, 4+ blocks), and
  the prompt's size (≤ 4, ≤ 16, ≤ 64, > 64 blocks); blocks of generated tokens form their own
  classes (by prompt size);
* a reused block — and a block that returns while remembered as a *ghost* (evicted lately: ARC's
  and S3-FIFO's lesson that a block asked for again soon after eviction is a frequent one) — by
  how often it has been reused (1, 2, 3–5, 6+).

**What it learns.** Per class, as the cache runs: how many of its blocks were reused and how many
left unused (evicted and then never asked for while remembered as a ghost), and how long a reuse
took (``decay`` forgets old observations). From that, the *value density* of a class: its reuse
probability over its expected time to reuse (hits per block-second). It also follows the cache's
*horizon*: how long a block sits unused before eviction takes it (a moving average of the idle
time of evicted blocks) — the time LRU alone would keep a block.

**How it decides.**

* a class whose reuse probability is below ``junk_probability`` gets ``junk_priority`` (no
  duration): evicted first;
* every other class is ranked by value density onto priorities ``min_priority``..``max_priority``
  (all above the default 35), with a retention duration of ``duration_factor`` × its typical time
  to reuse — for reused classes at least ``duration_factor`` × the horizon, so that what is reused
  again and again outlives LRU's horizon (ARC's frequency side; with a larger cache the horizon is
  longer and so is the protection). A block not reused by then falls back to 35, where LRU takes
  over: protection always ends, stale blocks cannot squat.

**The guard.** A shadow LRU cache of the same size, on a sample of the digests (SHARDS-style
spatial sampling, Waldspurger et al., FAST 2015: a digest is in the sample when its first byte is
below a threshold, and the shadow holds the same share of the capacity), measures what plain LRU
would have hit on the sampled blocks; the cache's own hits on the same blocks are counted too.
Every ``window`` sampled blocks, the *strength* of the protection goes up a step if the cache beat
the shadow and down ``down_factor`` steps if not. At strength 0 every block is stored at 35 with no
duration: exactly LRU. So where its predictions do not pay, the policy backs off to LRU.

Its state is bounded: per-class counters, the ghosts (``ghost_capacity``), the shadow
(``shadow_capacity`` × the sampling rate). Deterministic: the same calls give the same decisions.
It only ever *raises* a reused block (a client's system prompt pinned at 100 stays there).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eventbus.protocol import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from inference_node.kv.block import Block

#: Class ids: 0..31 new prompt blocks, 64..67 decode blocks, 68..71 reused blocks (32..63 unused).
_DIST = (0, 1, 2, 2, 3)  # distance from the prompt's end -> bucket (4+ -> 3)
_REUSE_CLASSES = 4
_DECODE_BASE = 64
_REUSED_BASE = 68
NUM_CLASSES = _REUSED_BASE + _REUSE_CLASSES
#: A retention decision: priority, duration (None: none), class.
Retention = tuple[int, float | None, int]


def _size_bucket(n_blocks: int) -> int:
    return 0 if n_blocks <= 4 else 1 if n_blocks <= 16 else 2 if n_blocks <= 64 else 3


def _reuse_bucket(hits: int) -> int:
    return 0 if hits <= 1 else 1 if hits == 2 else 2 if hits <= 5 else 3


def _new_class(index: int, prompt_blocks: int, matched: int) -> int:
    dist = prompt_blocks - 1 - index
    return (16 if matched > 1 else 0) + _DIST[dist if dist < 4 else 4] * 4 + _size_bucket(prompt_blocks)


@dataclass(frozen=True, slots=True)
class BlockContext:
    """What the core knows about a block when it is stored (:meth:`AdaptiveLearner.new_block`)."""

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
    :class:`AdaptiveLearner`, one per cache. The defaults were chosen on the Mooncake conversation
    trace and the generated families named in docs/benchmarks.md ("Adaptive eviction")."""

    junk_probability: float = 0.1
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
    #: later miss on one counts as the reuse it would have been, and the block returns as a reused
    #: one. Sized in blocks; 0 = 4 x the cache.
    ghost_capacity: int = 0
    #: The shadow LRU's capacity before sampling (0 = the cache's size), and the sampled blocks it
    #: aims to hold: the sampling rate is ``min(1, shadow_sample_blocks / capacity)``.
    shadow_capacity: int = 0
    shadow_sample_blocks: int = 2048
    #: Sampled prompt blocks per comparison with the shadow.
    window: int = 4000
    strength_step: float = 0.1
    down_factor: float = 2.0
    #: Observations (reuses, ghosts) between two computations of the class table.
    table_every: int = 512
    #: No protection lasts longer than this many horizons (LRU's residence time, measured).
    max_horizons: float = 16.0

    def __post_init__(self) -> None:
        for name in ("junk_priority", "min_priority", "max_priority"):
            v = getattr(self, name)
            if not 0 <= v <= 100:
                raise ValueError(f"{name} must be within 0..100, got {v}")
        if not self.min_priority <= self.max_priority:
            raise ValueError("min_priority must not exceed max_priority")
        if not 0 < self.decay <= 1:
            raise ValueError("decay must be within (0, 1]")
        if self.max_horizons <= 0:
            raise ValueError("max_horizons must be positive")


class AdaptiveLearner:
    """What the adaptive policy learns on one cache of ``cache_blocks`` blocks (both tiers), and
    the core's hooks into it (see the module docstring)."""

    def __init__(self, policy: AdaptivePolicy, cache_blocks: int) -> None:
        self.policy = policy
        self.ghost_capacity = policy.ghost_capacity or 4 * cache_blocks
        capacity = policy.shadow_capacity or cache_blocks
        rate = min(1.0, policy.shadow_sample_blocks / max(1, capacity))
        #: A digest is sampled when its first byte is below this (256: every digest).
        self.sample_below = max(1, round(256 * rate))
        self.shadow_capacity = max(1, round(capacity * self.sample_below / 256))
        self._stats = [_ClassStats() for _ in range(NUM_CLASSES)]
        self._ghosts: OrderedDict[bytes, tuple[int, float, float]] = OrderedDict()
        self._shadow: OrderedDict[bytes, float] = OrderedDict()  # digest -> last use
        self._strength = 1.0
        self._window = [0, 0, 0]  # the cache's sampled hits, the shadow's, sampled blocks
        self._ranks: list[tuple[int, float | None]] | None = None
        self._dirty = 0
        #: Set when the guard weakens protection: the core then ends the protections the
        #: policy gave (:meth:`KVCacheManager` calls ``BlockPool.revoke_adaptive``) and clears it.
        self.revoke_due = False
        #: Moving average of the idle time of evicted blocks (seconds).
        self.horizon_s = 0.0
        #: The last looked-up prompt's blocks that were ghosts: index -> reuses it counts as.
        self._returning: dict[int, int] = {}

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
        """(priority, duration) per class, recomputed after every ``table_every`` observations."""
        if self._ranks is not None and self._dirty < self.policy.table_every:
            return self._ranks
        pol = self.policy
        s = self._strength
        if s <= 0.0:  # backed off completely: plain LRU
            self._ranks, self._dirty = [(DEFAULT_PRIORITY, None)] * NUM_CLASSES, 0
            return self._ranks
        dens = []
        for c in range(NUM_CLASSES):
            p = self.probability(c)
            dens.append((p / max(self.mean_gap_s(c), 1e-3), c, p))
        useful = sorted((d, c) for d, c, p in dens if p >= pol.junk_probability)
        table: list[tuple[int, float | None]] = [(pol.junk_priority, None)] * NUM_CLASSES
        lo = DEFAULT_PRIORITY + s * (pol.min_priority - DEFAULT_PRIORITY)
        span = s * (pol.max_priority - pol.min_priority)
        horizon = self.horizon_s
        durations: list[tuple[int, int, float]] = []
        for rank, (_, c) in enumerate(useful):
            prio = round(lo + (span * rank / (len(useful) - 1) if len(useful) > 1 else span))
            if prio == DEFAULT_PRIORITY:
                table[c] = (prio, None)
                continue
            gap = self.mean_gap_s(c)
            if c >= _REUSED_BASE and horizon > gap:
                gap = horizon
            durations.append((c, prio, s * pol.duration_factor * gap))
        cap = pol.max_horizons * horizon if horizon > 0 else None
        for c, prio, d in durations:
            table[c] = (prio, d if cap is None or d < cap else cap)
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

    def on_lookup(self, digests: Sequence[bytes], matched: int, now: float) -> None:
        """A prompt was looked up: ``matched`` of its blocks were cached (call before storing
        the rest: :meth:`prompt_retention` then knows which of them return as ghosts).

        Misses on ghosts count as the reuses they would have been; the shadow LRU replays the
        sampled blocks of the same lookup, and the comparison tunes the strength of protection.
        """
        ghosts = self._ghosts
        self._returning = returning = {}
        if ghosts:
            for i in range(matched, len(digests)):
                ghost = ghosts.pop(digests[i], None)
                if ghost is not None:
                    cls, idle_s, evicted_at = ghost
                    self._observe(cls, True, idle_s + (now - evicted_at))
                    returning[i] = min(cls - _REUSED_BASE + 2, 6) if cls >= _REUSED_BASE else 1
        below = self.sample_below
        shadow = self._shadow
        window = self._window
        hit = True
        n = 0
        for i, d in enumerate(digests):
            if d[0] >= below:
                continue
            n += 1
            if i < matched:
                window[0] += 1
            if hit and d in shadow:
                window[1] += 1
                shadow.move_to_end(d)
            else:
                hit = False
            shadow[d] = now
        if not n:
            return
        excess = len(shadow) - self.shadow_capacity
        if excess > 0:
            for _ in range(excess):
                shadow.popitem(last=False)
            self.horizon_s = now - next(iter(shadow.values()))
        window[2] += n
        if window[2] >= self.policy.window:
            pol = self.policy
            if window[0] < window[1]:
                self._strength = max(0.0, self._strength - pol.strength_step * pol.down_factor)
                self.revoke_due = True
            elif window[0] > window[1]:
                self._strength = min(1.0, self._strength + pol.strength_step)
            window[0] = window[1] = window[2] = 0
            self._ranks = None

    def prompt_retention(self, prompt_blocks: int, matched: int, end: int) -> list[Retention]:
        """Priority, duration and class of the prompt's new blocks ``matched..end-1`` (after
        :meth:`on_lookup` for the same prompt)."""
        table = self._table()
        returning = self._returning
        cont = 16 if matched > 1 else 0
        size = _size_bucket(prompt_blocks)
        out: list[Retention] = []
        append = out.append
        for i in range(matched, end):
            if returning and i in returning:
                cls = _REUSED_BASE + _reuse_bucket(returning[i])
            else:
                dist = prompt_blocks - 1 - i
                cls = cont + _DIST[dist if dist < 4 else 4] * 4 + size
            prio, dur = table[cls]
            append((prio, dur, cls))
        return out

    def new_block(self, ctx: BlockContext) -> Retention:
        """Priority, duration and class of one new block (a decode block, or a prompt block out
        of a lookup)."""
        if ctx.is_decode:
            cls = _DECODE_BASE + _size_bucket(ctx.prompt_blocks)
        else:
            cls = _new_class(ctx.index, ctx.prompt_blocks, ctx.matched_blocks)
        prio, dur = self._table()[cls]
        return prio, dur, cls

    def on_reuse(self, cls: int, priority: int, hits: int, gap_s: float) -> Retention | None:
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

    def on_evict(self, blocks: Sequence[Block], now: float) -> None:
        """``blocks`` leave the cache (digests still set): remember each as a ghost, and follow the
        horizon."""
        ghosts = self._ghosts
        for b in blocks:
            cls = b.adaptive_class
            if 0 <= cls < NUM_CLASSES:
                ghosts[b.digest] = (cls, now - b.released_at, now)  # type: ignore[index]
        excess = len(ghosts) - self.ghost_capacity
        for _ in range(excess if excess > 0 else 0):
            _, (old_cls, _, _) = ghosts.popitem(last=False)
            self._observe(old_cls, False)  # never asked for again while remembered: not reused

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
        return {"strength": round(self._strength, 2), "horizon_s": round(self.horizon_s, 2),
                "sample_rate": round(self.sample_below / 256, 4), "classes": classes}
