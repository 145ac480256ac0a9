"""Life tables of the adaptive policy's two bands: how likely a block of a given age is to be used
again, learned online, so that eviction can weigh an old frequency block against a young recency
block (:mod:`inference_node.kv.adaptive`, "Life tables").

Per band — the recency band (35: blocks seen once) and the frequency band (36, and 34 where the
core demoted them) — the tables count, by the block's *age* (release ticks since its last use, in
half-octave buckets), the blocks that were used again at that age (*hits*), the blocks that left
the cache at that age (*ends*: evicted), and the blocks evictable now (*alive*: they have reached
their current age and not been used since). From them, for each age bucket ``k``:

    P(k) = (hits at ages >= k + W * P(k - 1)) / (hits + (ends + alive) / 2 at ages >= k + W)

the share of the blocks that reached age ``k`` which were used again at that age or later. An
evicted block and one evictable now are *censored* — not used again so far, but perhaps they
would be — and count as half a block that was not (``CENSORED``); a crowd of stale blocks still
weighs on its own age. The estimate is shrunk towards that of the next younger bucket with the
weight of ``W`` (``prior_blocks``) blocks, so that an age with little evidence inherits from the
ages below it (``P(-1) = 1``). The counts of hits and ends are halved every ``half_events`` of
them (old behaviour fades).

The core asks :meth:`LifeTables.frequency_first` when it must evict: the oldest frequency block
goes before the oldest recency block when its ``P`` is lower (on a tie — estimates within ``TIE``
of each other — the older one goes first, as in LRU). Where frequency pays (a system prompt
reused every few minutes, popular documents, users coming back after a scan) old frequency blocks
keep a high ``P`` and stay; where it does not (a phase of traffic that ended, a conversation that
will not return) they fall below the recency band's and go first, as LRU would take them.

Alive blocks are counted in *cohorts* of release ticks (``starts``: the first tick of each, oldest
first) whose spans grow with their age (merged when a cohort spans less than ``MERGE`` x its age),
so that a block leaving the evictable set finds its cohort by bisection and the tables are
recomputed from a few dozen cohorts, not from every block. Bounded state: ``NUM_BUCKETS`` buckets
per table, and about ``log(oldest age / cohort_ticks) / log(1 + MERGE)`` cohorts.

Pure and deterministic (no clock, no I/O): the core passes its release tick.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference_node.kv.block import Block

#: The bands, as the tables index them; None: a priority outside both (junk, a client's).
RECENCY_BAND = 0
FREQUENCY_BAND = 1
#: Half-octave age buckets: bucket 0 holds age 0, then two per power of two (ages up to 2**31
#: ticks; older ones share the last bucket).
NUM_BUCKETS = 64
#: A cohort merges into the next older one while their joint span is under this x its age.
MERGE = 0.25
#: Estimates within this share of each other are a tie, and a tie goes as in LRU (the older block
#: first): where the tables cannot tell the bands apart the cache keeps LRU's order rather than
#: follow noise (docs/benchmarks.md, "Life tables": 0.05 and 0.1 gave the same minima, 0.2 less).
TIE = 0.05
TIE_ABOVE, TIE_BELOW = 1.0 + TIE, 1.0 - TIE
#: What an evicted or still evictable block counts for among the blocks that reached an age: it was
#: not used again *so far* (censored: evicted, it might have been used had it stayed; alive, it may
#: be), so it counts as half a block that was not (docs/benchmarks.md, "Life tables": 1 or 0.25
#: for either moved the minima of the replays; 0.5 for both was the best of that grid).
CENSORED = 0.5


def age_bucket(age: int) -> int:
    """The half-octave bucket of an age in ticks (0, 1, 2, 3, 4-5, 6-7, 8-11, 12-15, ...).

    NOTE: the loops over blocks below inline this formula (a call per block cost 10 % of the
    adaptive policy's time on ``kvflow bench kv``'s replay)."""
    if age <= 1:
        return age if age > 0 else 0
    n = age.bit_length()
    b = 2 * n - 1 + ((age >> (n - 2)) & 1)
    return b if b < NUM_BUCKETS else NUM_BUCKETS - 1


_LAST = NUM_BUCKETS - 1
#: The youngest age of each bucket (and a bound past the last): bucket k holds ages
#: ``_AGE_LO[k] .. _AGE_LO[k + 1] - 1`` (an unused bucket holds none).
_AGE_LO = [0, 1, 2, 2] + [(2 if (k + 1) % 2 == 0 else 3) << ((k + 1) // 2 - 2)
                          for k in range(4, NUM_BUCKETS)] + [1 << 62]


class LifeTables:
    """See the module docstring. ``band_of``: the band of each priority (-1: none).
    ``cohort_ticks``: the span of the youngest cohorts (the finest resolution of the alive counts;
    the adaptive policy uses 1/64 of the cache)."""

    __slots__ = ("_events", "band_of", "cohort_ticks", "counts", "ends", "half_events", "hits", "p", "prior_blocks",
                 "starts")

    def __init__(self, prior_blocks: float, half_events: int, cohort_ticks: int, band_of: Sequence[int]) -> None:
        self.prior_blocks = prior_blocks
        self.half_events = max(1, half_events)
        self.cohort_ticks = max(1, cohort_ticks)
        self.band_of = list(band_of)
        #: Hits and ends per band and age bucket (faded: halved every ``half_events``).
        self.hits = [[0.0] * NUM_BUCKETS, [0.0] * NUM_BUCKETS]
        self.ends = [[0.0] * NUM_BUCKETS, [0.0] * NUM_BUCKETS]
        self._events = 0
        #: P per band and age bucket (:meth:`compute`); before the first computation all equal:
        #: the older block goes first, as in LRU.
        self.p = [[1.0] * NUM_BUCKETS, [1.0] * NUM_BUCKETS]
        #: Alive cohorts, oldest first: the first release tick of each and its [recency, frequency] counts.
        self.starts: list[int] = []
        self.counts: list[list[int]] = []

    # ---------------------------------------------------------------- events

    def _counted(self, n: int) -> None:
        """``n`` more hits or ends: halve the counts every ``half_events``."""
        self._events += n
        if self._events >= self.half_events:
            self._events = 0
            for t in (self.hits, self.ends):
                for band, row in enumerate(t):
                    t[band] = [x * 0.5 for x in row]

    def used(self, band: int, age: int, last_used: int) -> None:
        """An evictable block of ``band``, last used at tick ``last_used`` (``age`` ticks ago), is
        used again: a hit at its age, and it leaves the evictable set."""
        self.hits[band][age_bucket(age)] += 1.0
        self._counted(1)
        self.leave(band, last_used)

    def evicted(self, band: int, age: int, last_used: int) -> None:
        """An evictable block of ``band`` leaves the cache at ``age``."""
        self.ends[band][age_bucket(age)] += 1.0
        self._counted(1)
        self.leave(band, last_used)

    def blocks_used(self, blocks: Iterable[Block], tick: int) -> None:
        """:meth:`used` for each block of a lookup that was evictable (now in use by it alone) and
        in a band, at release tick ``tick``."""
        self._count(blocks, tick, self.hits, taken=True)

    def blocks_evicted(self, blocks: Iterable[Block], tick: int) -> None:
        """:meth:`evicted` for each evicted block in a band, at release tick ``tick``."""
        self._count(blocks, tick, self.ends, taken=False)

    def runs_evicted(self, runs: Iterable[Sequence[Block]], tick: int) -> None:
        """:meth:`blocks_evicted` for the runs the eviction index handed out
        (``EvictionIndex.take``): a run of one priority sorted by ``last_used``, or (from a heap)
        victims of possibly several priorities.

        NOTE: a run of one priority is split at the cohorts' starts and the buckets' bounds by
        bisection over its ``last_used`` (one list made per run, no Python work per block): on
        ``kvflow bench kv``'s replay the victims' accounting cost a third of what a loop over
        them did. The counts are the same."""
        band_of, ends, starts, counts = self.band_of, self.ends, self.starts, self.counts
        total = 0
        n_starts = len(starts)
        for run in runs:
            p = run[0].priority
            # a run from a heap may hold several priorities in any order (its first and last blocks
            # can agree while one between does not): every block's is checked
            if any(b.priority != p for b in run):
                self._count(run, tick, ends, taken=False)
                continue
            band = band_of[p]
            if band < 0:
                continue
            row = ends[band]
            lus = [b.last_used for b in run]
            n = len(lus)
            total += n
            # cohorts: those of the oldest and the newest block, and every one between
            pos = 0
            i = bisect_right(starts, lus[0]) - 1
            last_i = bisect_right(starts, lus[-1]) - 1
            while pos < n:
                q = bisect_left(lus, starts[i + 1], pos) if i + 1 < n_starts and i < last_i else n
                if i >= 0:
                    counts[i][band] -= q - pos
                pos, i = q, i + 1
            # age buckets, from the oldest block's down: bucket k holds last_used up to tick - _AGE_LO[k]
            a = tick - lus[0]
            m = a.bit_length()
            k = 2 * m - 1 + ((a >> (m - 2)) & 1) if m > 1 else a  # age_bucket(a), inlined
            if k > _LAST:
                k = _LAST
            pos = 0
            while pos < n:
                q = bisect_right(lus, tick - _AGE_LO[k], pos)
                row[k] += q - pos
                pos, k = q, k - 1
        if total:
            self._counted(total)

    def _count(self, blocks: Iterable[Block], tick: int, table: list[list[float]], taken: bool) -> None:
        """A hit (``table`` :attr:`hits`) or an end (:attr:`ends`) at its age for each block in a
        band (``taken``: only those now in use by one request, i.e. evictable before), each of
        which leaves the evictable set.

        NOTE: blocks come in runs of one band whose ages share a bucket and whose ``last_used``
        share a cohort (victims oldest first; a prompt's cached prefix, released together): such
        a run is counted at once (its first block finds the bucket, the cohort, and the range of
        ``last_used`` sharing both), which halved the time of the victims' accounting on
        ``kvflow bench kv``'s replay against a bisection and a bucket per block. The counts are
        the same."""
        band_of, starts, counts = self.band_of, self.starts, self.counts
        total = run = 0
        band = k = i = lo = hi = -1
        for b in blocks:
            if taken and b.ref != 1:
                continue
            bb = band_of[b.priority]
            if bb < 0:
                continue
            lu = b.last_used
            if bb == band and lo <= lu < hi:
                run += 1
                continue
            if run:
                table[band][k] += run
                if i >= 0:
                    counts[i][band] -= run
                total += run
            band, run = bb, 1
            a = tick - lu
            m = a.bit_length()
            k = 2 * m - 1 + ((a >> (m - 2)) & 1) if m > 1 else a  # age_bucket(a), inlined
            if k > _LAST:
                k = _LAST
            i = bisect_right(starts, lu) - 1
            # last_used with the same bucket: ages _AGE_LO[k] .. _AGE_LO[k + 1] - 1; the same cohort
            lo = tick - _AGE_LO[k + 1] + 1
            hi = tick - _AGE_LO[k] + 1
            if i >= 0 and starts[i] > lo:
                lo = starts[i]
            if i + 1 < len(starts) and starts[i + 1] < hi:
                hi = starts[i + 1]
        if run:
            table[band][k] += run
            if i >= 0:
                counts[i][band] -= run
            total += run
        if total:
            self._counted(total)

    def arrive(self, recency: int, frequency: int, first_tick: int) -> None:
        """Blocks became evictable with ``last_used`` from ``first_tick`` on (one release: the
        ticks it handed out), so many in each band."""
        if not recency and not frequency:
            return
        starts = self.starts
        if not starts or first_tick - starts[-1] >= self.cohort_ticks:
            starts.append(first_tick)
            self.counts.append([recency, frequency])
        else:
            c = self.counts[-1]
            c[0] += recency
            c[1] += frequency

    def leave(self, band: int, last_used: int) -> None:
        """An evictable block of ``band`` last used at ``last_used`` is no longer evictable (or
        no longer in ``band``)."""
        i = bisect_right(self.starts, last_used) - 1
        if i >= 0:
            self.counts[i][band] -= 1

    def move(self, old_band: int, new_band: int, last_used: int) -> None:
        """An evictable block changes band where it stands (its priority changed); -1: no band."""
        i = bisect_right(self.starts, last_used) - 1
        if i < 0:
            if new_band < 0 or not self.starts:
                return
            i = 0  # older than every cohort (it entered no band before): the oldest takes it
        c = self.counts[i]
        if old_band >= 0:
            c[old_band] -= 1
        if new_band >= 0:
            c[new_band] += 1

    # ---------------------------------------------------------------- estimates

    def _merge_cohorts(self, tick: int) -> None:
        """Drop the empty cohorts at the old end and merge each cohort into the next older one
        while their joint span is under ``MERGE`` x its age (bounded state)."""
        starts, counts = self.starts, self.counts
        drop = 0
        while drop < len(starts) - 1 and counts[drop][0] <= 0 and counts[drop][1] <= 0:
            drop += 1
        if drop:
            del starts[:drop], counts[:drop]
        if len(starts) < 2:
            return
        new_starts, new_counts = [starts[0]], [counts[0]]
        for i in range(1, len(starts)):
            end = starts[i + 1] if i + 1 < len(starts) else tick + 1
            if end - new_starts[-1] <= MERGE * (tick + 1 - end):
                prev = new_counts[-1]
                prev[0] += counts[i][0]
                prev[1] += counts[i][1]
            else:
                new_starts.append(starts[i])
                new_counts.append(counts[i])
        self.starts, self.counts = new_starts, new_counts

    def alive(self, tick: int) -> tuple[list[int], list[int]]:
        """Evictable blocks per band by age bucket (each cohort at the age of its middle)."""
        recency, frequency = [0] * NUM_BUCKETS, [0] * NUM_BUCKETS
        starts, counts = self.starts, self.counts
        ends = starts[1:] + [tick + 1] if starts else []
        for start, end, (r, f) in zip(starts, ends, counts, strict=True):
            a = tick - (start + end - 1) // 2
            m = a.bit_length()
            k = 2 * m - 1 + ((a >> (m - 2)) & 1) if m > 1 else a  # age_bucket(a), inlined
            if k > _LAST:
                k = _LAST
            if r > 0:
                recency[k] += r
            if f > 0:
                frequency[k] += f
        return recency, frequency

    def compute(self, tick: int) -> None:
        """Recompute :attr:`p` at release tick ``tick`` (the adaptive policy does it every
        ``life_every`` lookups)."""
        self._merge_cohorts(tick)
        alive = self.alive(tick)
        w = self.prior_blocks
        for band in (RECENCY_BAND, FREQUENCY_BAND):
            hits = self.hits[band]
            weighed = [h + CENSORED * (e + a) for h, e, a in zip(hits, self.ends[band], alive[band], strict=True)]
            hs = list(accumulate(reversed(hits)))[::-1]  # at this age or older
            reached = list(accumulate(reversed(weighed)))[::-1]
            out: list[float] = []
            prev = 1.0
            for h, r in zip(hs, reached, strict=True):
                if not r:  # no block reached this age: the older ones inherit
                    break
                prev = (h + w * prev) / (r + w)
                out.append(prev)
            out += [prev] * (NUM_BUCKETS - len(out))
            self.p[band] = out

    def frequency_first(self, frequency_age: int, recency_age: int) -> bool:
        """Whether the oldest frequency block (``frequency_age``) goes before the oldest recency
        block (``recency_age``): its P is lower beyond a tie (``TIE``), or within a tie and it is
        older (as in LRU)."""
        pf = self.p[FREQUENCY_BAND][age_bucket(frequency_age)]
        pr = self.p[RECENCY_BAND][age_bucket(recency_age)]
        return pf < pr * TIE_BELOW or (pf <= pr * TIE_ABOVE and frequency_age > recency_age)

    def describe(self, tick: int, ages: Sequence[int]) -> dict[str, object]:
        """P per band at some ages, and the evictable blocks per band (for the node's stats)."""
        alive = [0, 0]
        for c in self.counts:
            alive[0] += c[0]
            alive[1] += c[1]
        return {"alive": {"recency": alive[0], "frequency": alive[1]},
                "p": {str(a): {"recency": round(self.p[0][age_bucket(a)], 4),
                               "frequency": round(self.p[1][age_bucket(a)], 4)} for a in ages}}
