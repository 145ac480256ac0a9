"""Adaptive priorities: a cache without client hints that learns, online, what its traffic rewards.

When a request brings no retention config, the core asks this policy for each new block's
priority, and, when a block is reused, whether to raise it (through
:class:`~inference_node.kv.adaptive_eviction.AdaptiveEviction`, its
:class:`~inference_node.kv.policy.EvictionPolicy`; this module is what it learns). The policy speaks only the core's own
language: priorities, which show up in events and SQL like any client's (it gives no retention
durations), and eviction stays exactly "lowest priority first, least recently used first, leaves
only". A client's explicit retention config always wins: the policy is never asked then, and a
block a client re-prioritizes is the client's for good.

**Three bands**, evicted in this order:

* **junk** (``junk_priority``, below 35): a new block of a *class* that is almost never reused
  (and only if every new block after it in its prompt is junk too: the leaf rule would keep a
  junk parent of a kept block anyway);
* **recency** (35, the default): any other new block, seen once;
* **frequency** (36): a block reused at least once, or one that returns soon after its eviction
  (a miss on a *ghost*: an evicted block still remembered).

That is ARC's and S3-FIFO's structure in priorities: a block seen once waits in a probationary
space (ARC's T1, S3-FIFO's small FIFO) and is evicted before the blocks seen twice (T2, the main
FIFO); a block asked for again soon after its eviction goes straight to the protected space (a
hit in ARC's ghost lists, in S3-FIFO's ghost FIFO).

**Life tables.** Strict bands keep every block ever reused ahead of every block seen once,
however long ago its last use: right where reuse is frequent and long-lived (a shared prefix, a
popular document), wrong where a phase of traffic ended and its reused blocks are stale (then LRU
would have evicted them and kept the newer blocks). So the core does not take the recency band
first blindly: when it must evict, it compares the two bands' oldest blocks by how likely a block
of that band and age is to be used again — ``P``, estimated from the cache's own history per band
and age bucket (:mod:`inference_node.kv.lifetables`: the blocks that reached an age and were used
again at it or later, among all that reached it, the blocks evictable now included) — and lowers
the frequency band's oldest to ``DEMOTED_PRIORITY`` (34), where eviction takes it first, when its
``P`` is the lower (``updated`` events; a revoke returns them to 35). Where frequency pays, old
frequency blocks keep a high ``P`` and the bands stay strict (the conversation trace at 4,000
blocks, ghosts of 4 caches: 1.69 x LRU, strict bands 1.73 x); where it does not, they go first, as in LRU
(shifting_mix at 16,000 blocks: 1.0001 x LRU, where strict bands lost 0.17 %). An age with little
evidence inherits the estimate of the ages below it (``life_prior_blocks``), and old counts fade
(``life_half_events``).
It replaces the recency band's ARC-style target of the previous version
(docs/research/2026-12-adaptive-arc-target.md).
A cache with a host tier has no life tables (its GPU blocks are evicted one by one, offloading
them; measured on one tier only).

**Classes** (for the junk band), from what is known when a block is stored: whether its request
continued an earlier prompt (a prefix hit beyond the first block), its distance from the prompt's
end (0, 1, 2–3, 4+ blocks) and the prompt's size (≤ 4, ≤ 16, ≤ 64, > 64 blocks); generated blocks
by prompt size; reused blocks by how often they were reused (1, 2, 3–5, 6+). Per class the policy
counts reuses and blocks that left unused (evicted, then never asked for while remembered as a
ghost: ``ghost_caches`` x the cache, 3.5), forgetting old observations (``decay``); a class whose reuse
probability is below ``junk_probability`` is junk.

**The guard.** A sampled shadow (SHARDS-style spatial sampling, Waldspurger et al., FAST 2015: a
digest is in the sample when its first byte is below a threshold, and the shadow holds the same
share of the capacity) replays every lookup, and the cache's own prefix hits on the sampled blocks
are compared with the shadow's in a moving average (``guard_rate`` per lookup). While the bands
are on, the shadow is plain LRU; when the cache falls behind it by more than ``guard_margin`` of
the sampled blocks, the bands are turned off: every block in the frequency band returns to 35
(``AdaptiveEviction._revoke``) and reused ones stay at 35 — LRU, with only the junk band left.
While they are off, the shadow is one of the bands (a probationary and a protected LRU list, the
probationary one evicted first, with ghosts), and the bands return when it leads the cache by the
same margin. One of these two shadows runs at a time (the other keeps what it held; it is stale
when its turn comes, which delays a switch back a little). Measurements behind these choices:
docs/research/2026-12-adaptive-guard.md.

**The life tables' guard** (``strict_guard``). The life tables demote old frequency blocks when
their estimate says a recency block is likelier to be used again; the estimate learns from what
the cache keeps, so blocks it demotes early are never seen reused old, and where old frequency
blocks do pay (many tenants' prefixes in a small cache) it keeps demoting them. While the bands
are on, a third shadow (strict bands, sampled the same way, its own ghosts) replays every lookup,
and when it leads the cache by the guard's margin (the same moving average) the tables stop
demoting: *strict bands*. When the cache then falls behind the LRU shadow by the margin, the
tables demote again, and strict bands may return only after a hold (1 / ``guard_rate`` lookups,
doubled after each strict stretch shorter than the hold before it), in which the LRU guard can
turn the bands off if the cache stays behind LRU. Measured:
docs/research/2026-12-adaptive-strict-guard.md.

Its state is bounded: per-class counters, the ghosts (``ghost_capacity``), the shadows (about
``shadow_sample_blocks`` blocks each; the bands' shadow remembers ``ghost_caches`` x as many ghosts).
Deterministic: the same calls give the same decisions. It only ever *raises* a reused block (a
client's system prompt pinned at 100 stays).

What it does not see: the router. Behind KV-aware routing, in the simulator, nodes with this
policy did worse than LRU nodes (recency first makes a conversation's newest blocks leave soon,
and the router scatters its next turns) while every node's guard saw its cache ahead of its
shadow: docs/benchmarks.md ("The bands lose in a routed fleet"). Two settings, off by default, are
for such nodes: ``frequency_horizons`` (a reused block keeps the frequency band only so many LRU
horizons after its last use) and ``soon_share`` (a new block goes straight to the frequency band
when its class's reuses mostly come *soon*: within as many block releases as the cache holds
blocks, where LRU would have hit them — a conversation's newest blocks, reused by its next turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference_node.kv.adaptive_settings import DEMOTED_PRIORITY, FREQUENCY_PRIORITY, RECENCY_PRIORITY, AdaptivePolicy
from inference_node.kv.eviction import NUM_PRIORITIES
from inference_node.kv.floor import LruFloor
from inference_node.kv.lifetables import FREQUENCY_BAND, RECENCY_BAND
from inference_node.kv.shadows import CLASS_MASK, StrictGuard, native_available, tables

if TYPE_CHECKING:
    from inference_node.kv.block import Block

__all__ = ["DEMOTED_PRIORITY", "FREQUENCY_PRIORITY", "NUM_CLASSES", "RECENCY_PRIORITY",
           "AdaptiveLearner", "AdaptivePolicy", "BlockContext"]

#: Class ids: 0..31 new prompt blocks, 64..67 decode blocks, 68..71 reused blocks (32..63 unused).
_DIST = (0, 1, 2, 2, 3)  # distance from the prompt's end -> bucket (4+ -> 3)
_REUSE_CLASSES = 4
_DECODE_BASE = 64
_REUSED_BASE = 68
NUM_CLASSES = _REUSED_BASE + _REUSE_CLASSES
#: A retention decision: priority, duration (None unless ``frequency_horizons`` is set), class.
Retention = tuple[int, float | None, int]


def _band(priority: int) -> int:
    """The life tables' band of a priority: the recency band, the frequency band (demoted blocks
    included), or -1 (junk, a client's priority)."""
    if priority == RECENCY_PRIORITY:
        return RECENCY_BAND
    if priority in (FREQUENCY_PRIORITY, DEMOTED_PRIORITY):
        return FREQUENCY_BAND
    return -1


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
    soon: float = 0.0  # of the reuses, those within the cache's size in block releases


class AdaptiveLearner:
    """What the adaptive policy learns on one cache of ``cache_blocks`` blocks (both tiers), and
    the core's hooks into it (see the module docstring). ``tiered``: the cache has a host tier —
    no life tables there (the core evicts GPU blocks one by one, offloading them; the tables were
    measured on one tier only)."""

    def __init__(self, policy: AdaptivePolicy, cache_blocks: int, tiered: bool = False) -> None:
        self.policy = policy
        c = max(1, cache_blocks)
        self.cache_blocks = c
        self.ghost_capacity = policy.ghost_capacity or max(1, round(policy.ghost_caches * c))
        rate = min(1.0, policy.shadow_sample_blocks / c)
        #: A digest is sampled when its first byte is below this (256: every digest).
        self.sample_below = max(1, round(256 * rate))
        self.shadow_capacity = max(1, round(c * self.sample_below / 256))
        self._stats = [_ClassStats() for _ in range(NUM_CLASSES)]
        ghost_fifo, lru_shadow, bands_shadow, life_tables, exact_lru = tables(policy.compiled)
        #: Which tables hold the state: ``compiled`` (``kvflow_native``) or ``python``.
        self.tables = "compiled" if policy.compiled and native_available() else "python"
        #: digest -> class, with soon_share also its last use: ``last_used << 7 | class``
        self._ghosts = ghost_fifo(self.ghost_capacity)
        self._soon = policy.soon_share > 0
        #: The pool's release tick at the last lookup, and the reuse distance (in ticks) that is "soon".
        self._tick = 0
        self._soon_within = c
        #: The bands are on; off: no frequency band (LRU, with the junk band).
        self.bands = True
        #: The shadows: LRU (run while the bands are on) and the bands' (run while they are off).
        self._lru = lru_shadow(self.shadow_capacity, timed=policy.frequency_horizons > 0)
        self._shadow = bands_shadow(self.shadow_capacity, max(1, round(self.ghost_capacity * rate)))
        self._lead = 0.0  # moving average of own minus LRU's (bands on), bands' minus own (off) sampled hits
        self._sampled = 0.0  # moving average of sampled blocks per lookup
        self._lookups = 0
        #: How often the guard turned the bands off or on.
        self.switches = 0
        self._ranks: list[int] | None = None
        self._dirty = 0
        #: Set when the guard turns the bands off: the policy then returns every block it raised
        #: above 35 to 35 (``AdaptiveEviction._revoke``) and clears it.
        self.revoke_due = False
        #: The last looked-up prompt's blocks that were ghosts: index -> reuses it counts as.
        self._returning: dict[int, int] = {}
        #: The life tables (module docstring); None: off, or a cache with a host tier.
        self.life = life_tables(policy.life_prior_blocks, policy.life_half_events, max(1, c // 64),
                                [_band(p) for p in range(NUM_PRIORITIES)]) \
            if policy.life_tables and not tiered else None
        self._life_lookups = 0
        #: The life tables' guard (None: no life tables, or ``strict_guard`` off).
        self.strict_guard = StrictGuard(bands_shadow(self.shadow_capacity, max(1, round(self.ghost_capacity * rate)))) \
            if policy.strict_guard and self.life is not None else None
        #: Frequency blocks the core lowered to ``DEMOTED_PRIORITY`` because of the tables.
        self.life_demotions = 0
        #: The floor against LRU (:mod:`inference_node.kv.floor`); None: off.
        self.floor = LruFloor(c, policy.floor_share, min(policy.floor_blocks, policy.floor_caches * c),
                              policy.floor_retry, exact_lru) if policy.floor else None
        #: Set when the floor engages: the core returns every block the policy placed, junk and
        #: demoted ones too, to 35 (``AdaptiveEviction._revoke(everything=True)``) and clears it.
        self.floor_due = False

    @property
    def strict(self) -> bool:
        """Strict bands now: the life tables' guard holds their demotions."""
        return self.strict_guard is not None and self.strict_guard.on

    @property
    def lru_only(self) -> bool:
        """The floor holds the cache at plain LRU: every block the policy stores or reuses at 35,
        no demotion."""
        return self.floor is not None and self.floor.engaged

    # ---------------------------------------------------------------- estimates

    def _dur(self, prio: int) -> float | None:
        """The retention duration of a block stored or raised at ``prio``: ``frequency_horizons``
        x the LRU shadow's horizon for the frequency band (None: off, or no horizon yet)."""
        h = self.policy.frequency_horizons
        horizon: float = self._lru.horizon
        if prio != FREQUENCY_PRIORITY or h <= 0 or horizon <= 0:
            return None
        return h * horizon

    def soon_probability(self, cls: int) -> float:
        """The share of the class's observations that were reuses within the cache's size."""
        s = self._stats[cls]
        return s.soon / (s.reused + s.evicted + self.policy.min_samples)

    def probability(self, cls: int) -> float:
        s = self._stats[cls]
        w = self.policy.min_samples
        return (s.reused + w * self.policy.prior_probability) / (s.reused + s.evicted + w)

    def _table(self) -> list[int]:
        """The priority of each class, recomputed after every ``table_every`` observations."""
        if self._ranks is not None and self._dirty < self.policy.table_every:
            return self._ranks
        pol = self.policy
        if self.lru_only:
            self._ranks, self._dirty = [RECENCY_PRIORITY] * NUM_CLASSES, 0
            return self._ranks
        frequency = FREQUENCY_PRIORITY if self.bands else RECENCY_PRIORITY  # off: LRU (and junk)
        soon = pol.soon_share
        table = [pol.junk_priority if self.probability(c) < pol.junk_probability
                 else frequency if c >= _REUSED_BASE or (soon and self.soon_probability(c) >= soon)
                 else RECENCY_PRIORITY
                 for c in range(NUM_CLASSES)]
        self._ranks, self._dirty = table, 0
        return table

    def _observe(self, cls: int, reused: bool, last_used: int = -1) -> None:
        """One observation of ``cls``: a reuse (of a block last used at tick ``last_used``; -1:
        unknown) or a block that left unused."""
        s = self._stats[cls]
        decay = self.policy.decay
        s.reused *= decay
        s.evicted *= decay
        s.soon *= decay
        if reused:
            s.reused += 1
            if last_used >= 0 and 0 <= self._tick - last_used < self._soon_within:  # (no tick given: not soon)
                s.soon += 1
        else:
            s.evicted += 1
        self._dirty += 1

    # ---------------------------------------------------------------- the core's hooks

    def on_lookup(self, digests: Sequence[bytes], matched: int, now: float, tick: int = 0,
                  held: int = 0) -> None:
        """A prompt was looked up at ``now``: ``matched`` of its blocks were cached (call before
        storing the rest: :meth:`prompt_retention` then knows which of them return as ghosts).
        ``tick``: the pool's release tick now (``Block.last_used`` counts in it); ``held``: the
        slots other requests hold with no cached block in them (the floor's shadow leaves them).

        Misses on ghosts count as the reuses they would have been; the shadows replay the sampled
        blocks of the same lookup, and the guard compares.
        """
        self._returning = returning = {}
        self._tick = tick
        for i, ghost in self._ghosts.take(digests, matched):
            cls = ghost & CLASS_MASK
            self._observe(cls, True, ghost >> 7 if self._soon else -1)
            returning[i] = min(cls - _REUSED_BASE + 2, 6) if cls >= _REUSED_BASE else 1
        self._lru.now = now
        self._shadows(digests, matched)
        floor = self.floor
        if floor is not None and floor.step(digests, matched, self.cache_blocks - held if held > 0 else None):
            self._ranks = None
            self.floor_due = floor.engaged
        life = self.life
        if life is not None:
            self._life_lookups += 1
            if self._life_lookups >= self.policy.life_every:
                self._life_lookups = 0
                life.compute(tick)

    def _shadows(self, digests: Sequence[bytes], matched: int) -> None:
        bands = self.bands
        strict = self.strict_guard
        if bands and strict is not None:
            strict.step(digests, matched, self.sample_below, max(self.policy.guard_rate, 1.0 / max(1, self._lookups)),
                        self.policy.guard_margin * self._sampled)
        # n sampled digests, the cache's own prefix hits on them, the shadow's
        n, own, other = (self._lru if bands else self._shadow).lookup(digests, matched, self.sample_below)
        if not n:
            return
        self._lookups += 1
        w = max(self.policy.guard_rate, 1.0 / self._lookups)
        self._lead += w * ((own - other if bands else other - own) - self._lead)
        self._sampled += w * (n - self._sampled)
        margin = self.policy.guard_margin * self._sampled
        if bands and self._lead < -margin and strict is not None and strict.on:
            strict.off(round(1.0 / self.policy.guard_rate))  # behind LRU: the life tables again, before LRU
            self._lead = 0.0
            return
        if bands and self._lead < -margin:
            self.bands = False
            self.revoke_due = True
        elif not bands and self._lead > margin:
            self.bands = True
        else:
            return
        self.switches += 1
        self._ranks = None

    def prompt_retention(self, prompt_blocks: int, matched: int, end: int) -> list[Retention]:
        """Priority, duration and class of the prompt's new blocks ``matched..end-1`` (after
        :meth:`on_lookup` for the same prompt).

        A block is junk only if every new block after it is junk too: the leaf rule keeps a parent
        while its child is cached anyway, and a junk parent of a kept child would only wait, parked,
        for it (measured: the same hit rates on every workload, 5 % less cost on the trace).
        """
        table = self._table()
        returning = self._returning
        cont = 16 if matched > 1 else 0
        size = _size_bucket(prompt_blocks)
        junk = self.policy.junk_priority
        frequency_duration = self._dur(FREQUENCY_PRIORITY)
        kept = False  # a later block is not junk
        out: list[Retention] = []
        append = out.append
        for i in range(end - 1, matched - 1, -1):
            if returning and i in returning:
                cls = _REUSED_BASE + _reuse_bucket(returning[i])
            else:
                dist = prompt_blocks - 1 - i
                if dist >= 4 and not returning:  # this block and every one before it: one class
                    cls = cont + _DIST[4] * 4 + size
                    prio = table[cls]
                    if prio == junk and kept:
                        prio = RECENCY_PRIORITY
                    out += [(prio, frequency_duration if prio == FREQUENCY_PRIORITY else None, cls)] * (i - matched + 1)
                    break
                cls = cont + _DIST[dist if dist < 4 else 4] * 4 + size
            prio = table[cls]
            if prio != junk:
                kept = True
            elif kept:
                prio = RECENCY_PRIORITY
            append((prio, frequency_duration if prio == FREQUENCY_PRIORITY else None, cls))
        out.reverse()
        return out

    def new_block(self, ctx: BlockContext) -> Retention:
        """Priority, duration and class of one new block (a decode block, or a prompt block out
        of a lookup)."""
        if ctx.is_decode:
            cls = _DECODE_BASE + _size_bucket(ctx.prompt_blocks)
        else:
            cls = _new_class(ctx.index, ctx.prompt_blocks, ctx.matched_blocks)
        return self._table()[cls], None, cls

    def on_reuse(self, cls: int, priority: int, hits: int, last_used: int = -1) -> Retention | None:
        """A cached block of class ``cls`` at ``priority`` is reused (``hits``: earlier reuses;
        ``last_used``: its ``Block.last_used``, after :meth:`on_lookup` of the same prompt).

        Returns the raised priority, duration and new class, or None to leave the block alone.
        """
        if cls < 0:
            return None
        # NOTE: _observe(cls, True, ...), _reuse_bucket and _table inlined: this runs for every
        # reused block (with soon_share off no share is counted, nor ghosts').
        s = self._stats[cls]
        decay = self.policy.decay
        s.reused = s.reused * decay + 1.0
        s.evicted *= decay
        s.soon *= decay
        if self._soon and last_used >= 0 and 0 <= self._tick - last_used < self._soon_within:
            s.soon += 1
        self._dirty += 1
        h = hits + 1
        new_cls = _REUSED_BASE + (0 if h <= 1 else 1 if h == 2 else 2 if h <= 5 else 3)
        ranks = self._ranks
        if ranks is None or self._dirty >= self.policy.table_every:
            ranks = self._table()
        prio = ranks[new_cls]
        if prio < priority:
            return None
        return prio, self._dur(prio) if prio == FREQUENCY_PRIORITY else None, new_cls

    # ---------------------------------------------------------------- the life tables' hooks

    def taken(self, blocks: Sequence[Block]) -> None:
        """The cached blocks a lookup takes into use (after :meth:`on_lookup` of it): each one in
        a band that was evictable (``ref`` 1 now) is a hit at its age."""
        if self.life is not None:
            self.life.blocks_used(blocks, self._tick)

    def given_back(self, b: Block) -> None:
        """``b`` was taken into use by an allocation that failed and is released unused: it
        leaves its band here (the release brings it back, newest)."""
        life = self.life
        if life is not None and b.ref == 1:
            band = _band(b.priority)
            if band >= 0:
                life.leave(band, b.last_used)

    def released(self, arrived: list[int], first_tick: int) -> None:
        """A release made blocks evictable, with ``last_used`` from tick ``first_tick`` on:
        ``arrived`` counts them per priority (``EvictionIndex.arrived``; read and reset here)."""
        r = arrived[RECENCY_PRIORITY]
        f = arrived[FREQUENCY_PRIORITY] + arrived[DEMOTED_PRIORITY]
        arrived[RECENCY_PRIORITY] = arrived[FREQUENCY_PRIORITY] = arrived[DEMOTED_PRIORITY] = 0
        if self.life is not None:
            self.life.arrive(r, f, first_tick)

    def moved(self, b: Block, old: int) -> None:
        """An evictable block changed priority from ``old`` to ``b.priority`` where it stands."""
        life = self.life
        if life is None:
            return
        old_band, new_band = _band(old), _band(b.priority)
        if old_band != new_band:
            life.move(old_band, new_band, b.last_used)

    def on_evict(self, blocks: Sequence[Block], tick: int = 0, runs: Sequence[Sequence[Block]] | None = None) -> None:
        """``blocks`` leave the cache (digests still set) at release tick ``tick``: remember each
        as a ghost (and, with the life tables, an end at its age). ``runs``: the same blocks as
        the eviction index handed them out (``EvictionIndex.take``), which the tables count faster."""
        if self.life is not None:
            if runs is not None:
                self.life.runs_evicted(runs, tick)
            else:
                self.life.blocks_evicted(blocks, tick)
        left = self._ghosts.add(blocks, self._soon)
        if left:  # never asked for again while remembered: not reused (_observe, per class)
            decay = self.policy.decay
            for cls, n in left:  # n observations of "left unused" in a row: n decays, and the decayed ones
                s = self._stats[cls]
                d = decay ** n
                s.reused *= d
                s.soon *= d
                s.evicted = s.evicted * d + (n if decay == 1.0 else (1.0 - d) / (1.0 - decay))
                self._dirty += n

    def describe(self) -> dict[str, object]:
        """The learned state, for the node's stats endpoint and the benchmarks."""
        classes = []
        for c, priority in enumerate(self._table()):
            s = self._stats[c]
            if s.reused + s.evicted == 0:
                continue
            classes.append({"class": c, "probability": round(self.probability(c), 4),
                            "soon": round(self.soon_probability(c), 4), "priority": priority})
        life = None if self.life is None else {
            "demotions": self.life_demotions,
            **self.life.describe(self._tick, (self.cache_blocks // 4, self.cache_blocks, 4 * self.cache_blocks))}
        strict = None if self.strict_guard is None else self.strict_guard.describe()
        return {"bands": self.bands, "switches": self.switches, "guard_lead": round(self._lead, 4), "strict": strict,
                "life": life, "floor": None if self.floor is None else self.floor.describe(),
                "sample_rate": round(self.sample_below / 256, 4), "classes": classes, "tables": self.tables}
