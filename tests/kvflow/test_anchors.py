"""ARC and S3-FIFO, the hit-rate anchors of ``kvflow bench kv`` (``kvflow/anchors.py``): bounded
state, prefix semantics, and what each paper says the policy is for (a scan does not flush them)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvflow.anchors import Arc, S3Fifo, arc_hit_rate, s3fifo_hit_rate

pytestmark = pytest.mark.unit


def lru_hit_rate(requests: list[list[int]], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for ks in requests:
        total += len(ks)
        for k in ks:
            if k not in cache:
                break
            hits += 1
        for k in ks:
            cache[k] = None
            cache.move_to_end(k)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total


@pytest.mark.parametrize("seed", range(5))
def test_state_stays_within_the_papers_bounds(seed):
    rng = random.Random(seed)
    arc, s3 = Arc(50), S3Fifo(50)
    for _ in range(5000):
        k = int(rng.paretovariate(1.2)) % 400
        arc.access(k)
        s3.access(k)
        assert len(arc.t1) + len(arc.t2) <= 50 and len(arc.t1) + len(arc.b1) <= 50
        assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 100 and 0 <= arc.p <= 50
        assert len(s3.small) + len(s3.main) <= 50 and len(s3.ghost) <= s3.main_cap
        assert all(0 <= c <= 3 for c in (*s3.small.values(), *s3.main.values()))


def test_a_hit_is_the_cached_run_from_the_start():
    for replay in (arc_hit_rate, s3fifo_hit_rate):
        # [9, 2] after [1, 2]: block 2 is cached but follows a miss: no hit
        assert replay([[1, 2], [9, 2], [1, 2]], 10).hit_blocks == 2, replay


def test_one_time_scans_do_not_flush_a_hot_prefix_as_they_flush_lru():
    rng = random.Random(3)
    requests, fresh = [], 1000
    for _ in range(300):
        requests.append([1, 2, 3, 4])  # a hot system prompt ...
        requests.append(list(range(fresh, fresh + 12)))  # ... between one-time scans longer than the cache
        fresh += 12
        if rng.random() < 0.5:
            requests.append([1, 2, 3, 4, 5])
    lru = lru_hit_rate(requests, 10)  # every scan flushes LRU: it hits only right after a hot request
    assert lru < 0.15
    assert arc_hit_rate(requests, 10).hit_rate > 2 * lru and s3fifo_hit_rate(requests, 10).hit_rate > 2 * lru
