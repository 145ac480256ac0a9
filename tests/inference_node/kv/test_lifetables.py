"""The adaptive policy's life tables (inference_node/kv/lifetables.py), exactly: age buckets, the
estimate of each band from its hits, ends and evictable blocks, fading, cohorts, the comparison."""

from __future__ import annotations

import random

import pytest

from inference_node.kv.lifetables import (
    CENSORED,
    FREQUENCY_BAND,
    MERGE,
    NUM_BUCKETS,
    RECENCY_BAND,
    LifeTables,
    age_bucket,
)

BANDS = [-1] * 34 + [1, 0, 1] + [-1] * 64  # 34, 35, 36 as the adaptive policy maps them


def test_age_buckets_are_half_octaves():
    assert [age_bucket(a) for a in (-3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16)] == \
        [0, 0, 1, 3, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9]
    assert age_bucket(1 << 60) == NUM_BUCKETS - 1  # the oldest bucket takes every older age


def test_the_estimate_is_the_share_of_blocks_reaching_an_age_that_were_used_again_at_it_or_later():
    t = LifeTables(prior_blocks=0.0, half_events=10**9, cohort_ticks=1, band_of=BANDS)
    for _ in range(3):
        t.used(RECENCY_BAND, 10, 0)  # three hits at age 10 ...
    t.evicted(RECENCY_BAND, 100, 0)  # ... one block evicted at age 100 ...
    t.arrive(2, 0, first_tick=1000)  # ... two evictable now, last used at tick 1000
    t.leave(RECENCY_BAND, 0)  # (used and evicted blocks leave the alive counts; tick 0 is no cohort's)
    t.leave(RECENCY_BAND, 0)
    t.compute(tick=1050)  # the two alive ones are 50 ticks old
    p = t.p[RECENCY_BAND]
    censored = CENSORED * (1 + 2)  # the evicted block and the two alive ones count half each
    assert p[age_bucket(10)] == pytest.approx(3 / (3 + censored))  # every block reached age 10
    assert p[age_bucket(50)] == 0.0  # none of the three that reached age 50 was used again
    assert p[age_bucket(100)] == 0.0
    assert t.p[FREQUENCY_BAND][age_bucket(10)] == 1.0  # no evidence: the prior P(-1) = 1 all the way


def test_an_age_with_little_evidence_inherits_the_estimate_of_the_younger_ages():
    t = LifeTables(prior_blocks=4.0, half_events=10**9, cohort_ticks=1, band_of=BANDS)
    for _ in range(4):
        t.used(FREQUENCY_BAND, 2, 0)  # bucket 3
    t.evicted(FREQUENCY_BAND, 2, 0)
    t.compute(tick=0)
    p = t.p[FREQUENCY_BAND]
    # Buckets 0..3 all hold the 5 events (every block reached those ages); the prior starts at 1.
    expected = 1.0
    for _ in range(4):  # buckets 0, 1, 2, 3
        expected = (4 + 4.0 * expected) / (4 + CENSORED + 4.0)
    assert p[3] == pytest.approx(expected)
    assert p[4] == pytest.approx(expected)  # nothing reached bucket 4: it inherits
    assert p[NUM_BUCKETS - 1] == pytest.approx(expected)


def test_counts_fade_by_half_every_so_many_events():
    t = LifeTables(prior_blocks=0.0, half_events=4, cohort_ticks=1, band_of=BANDS)
    for _ in range(3):
        t.used(RECENCY_BAND, 1, 0)
    assert t.hits[RECENCY_BAND][1] == 3.0
    t.evicted(FREQUENCY_BAND, 1, 0)  # the 4th event: everything halves
    assert t.hits[RECENCY_BAND][1] == 1.5 and t.ends[FREQUENCY_BAND][1] == 0.5


def test_cohorts_count_the_evictable_blocks_and_merge_as_they_age_without_losing_any():
    rng = random.Random(7)
    t = LifeTables(prior_blocks=800.0, half_events=4096, cohort_ticks=4, band_of=BANDS)
    alive: list[tuple[int, int]] = []  # (band, last_used) of each evictable block
    tick = 0
    for _ in range(3000):
        n_r, n_f = rng.randint(0, 3), rng.randint(0, 2)
        first = tick + 1
        t.arrive(n_r, n_f, first)
        alive += [(RECENCY_BAND, first + i) for i in range(n_r)] + [(FREQUENCY_BAND, first + n_r + i)
                                                                   for i in range(n_f)]
        tick += n_r + n_f
        for _ in range(rng.randint(0, 4)):
            if alive:
                band, last = alive.pop(rng.randrange(len(alive)))
                if rng.random() < 0.2:  # a move: the block changes band where it stands
                    t.move(band, 1 - band, last)
                    alive.append((1 - band, last))
                else:
                    t.leave(band, last)
        if rng.random() < 0.1:
            t.compute(tick)
    t.compute(tick)
    assert [sum(c[b] for c in t.counts) for b in (0, 1)] == [sum(1 for b, _ in alive if b == band)
                                                              for band in (0, 1)]
    starts = t.starts
    assert starts == sorted(starts) and len(starts) < 80  # bounded: spans grow with age
    for i in range(1, len(starts)):  # no two neighbours left that the rule would merge
        end = starts[i + 1] if i + 1 < len(starts) else tick + 1
        assert end - starts[i - 1] > MERGE * (tick + 1 - end)
    by_age = t.alive(tick)
    assert sum(by_age[0]) + sum(by_age[1]) == len(alive)


def test_the_older_block_goes_first_on_a_tie_and_the_lower_estimate_goes_first_otherwise():
    t = LifeTables(prior_blocks=0.0, half_events=10**9, cohort_ticks=1, band_of=BANDS)
    assert t.frequency_first(100, 10) and not t.frequency_first(10, 100)  # no estimates yet: as LRU
    t.p[FREQUENCY_BAND] = [0.2] * NUM_BUCKETS
    t.p[RECENCY_BAND] = [0.3] * NUM_BUCKETS
    assert t.frequency_first(10, 100)  # less likely to be used again, though younger
    t.p[FREQUENCY_BAND] = [0.4] * NUM_BUCKETS
    assert not t.frequency_first(100, 10)
    described = t.describe(50, (10,))
    assert described["p"] == {"10": {"recency": 0.3, "frequency": 0.4}}
    assert described["alive"] == {"recency": 0, "frequency": 0}


def test_each_bucket_holds_the_ages_its_lower_bounds_say():
    from inference_node.kv.lifetables import _AGE_LO

    rng = random.Random(3)
    for a in [*range(5000), *(rng.randrange(1 << 40) for _ in range(5000))]:
        k = age_bucket(a)
        assert _AGE_LO[k] <= a and (k == NUM_BUCKETS - 1 or a < _AGE_LO[k + 1])


def test_victims_counted_in_runs_give_the_same_tables_as_one_by_one():
    from inference_node.kv.block import Block

    rng = random.Random(11)
    for _ in range(200):
        batched = LifeTables(prior_blocks=0.0, half_events=10**9, cohort_ticks=8, band_of=BANDS)
        single = LifeTables(prior_blocks=0.0, half_events=10**9, cohort_ticks=8, band_of=BANDS)
        tick = 0
        for t in (batched, single):
            t.arrive(10**6, 10**6, 1)  # plenty alive in one cohort; more cohorts below
        victims = []
        for _ in range(rng.randint(1, 60)):
            tick += rng.randint(1, 40)
            for t in (batched, single):
                t.arrive(1, 1, tick)
            b = Block(0, 0)
            b.priority = rng.choice((34, 35, 36, 5, 100))
            b.last_used, b.adaptive_class = tick, rng.choice((0, 68, -1))
            victims.append(b)
        victims.sort(key=lambda b: (b.priority, b.last_used))  # as the eviction index hands them out
        now = tick + rng.randint(0, 5000)
        if rng.random() < 0.5:
            batched.blocks_evicted(victims, now)
        else:  # in runs: some of one priority, some (from a heap) of several
            runs, i = [], 0
            while i < len(victims):
                j = i + rng.randint(1, 12)
                runs.append(victims[i:j])
                i = j
            batched.runs_evicted(runs, now)
        for b in victims:
            band = BANDS[b.priority]
            if band >= 0:
                single.evicted(band, now - b.last_used, b.last_used)
        assert batched.ends == single.ends and batched.counts == single.counts
