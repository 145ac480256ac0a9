"""The compiled tables of the adaptive policy (``kvflow_native``: ``native/src/adaptive.rs`` and
``native/src/lifetables.rs``) decide exactly what the Python ones (:mod:`inference_node.kv.shadows`,
:mod:`inference_node.kv.lifetables`) decide.

Both run on the same random calls — keys reused, re-added, taken back, of several lengths; blocks
arriving, used, evicted one by one, in batches and in runs, moved between bands; estimates — and
every answer, size, count and estimate is compared after each call; then whole caches with the
adaptive policy (the default settings and the routed fleet's, on a host-tier cache too) run the
same traffic with either, and their event streams and learned state are compared.
"""

from __future__ import annotations

import os
import random

import pytest

from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.block import Block
from inference_node.kv.clock import ManualClock
from inference_node.kv.floor import ExactLru
from inference_node.kv.lifetables import LifeTables
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.kv.prompt import Prompt
from inference_node.kv.shadows import BandsShadow, GhostFifo, LruShadow, native_available, tables
from kvflow.sim.workloads import GENERATORS, as_trace
from kvflow.traces import trace_prompts

if not native_available():
    if os.environ.get("KVFLOW_REQUIRE_NATIVE") == "1":
        pytest.fail("kvflow_native is not installed (make install builds it)", pytrace=False)
    pytest.skip("kvflow_native is not installed (pip install ./native)", allow_module_level=True)

NativeGhosts, NativeLru, NativeBands, NativeLife, NativeExact = tables(True)


def keys(rng: random.Random, universe: int) -> list[bytes]:
    """A lookup's keys: several lengths (up to 32 bytes), first bytes spread for sampling."""
    out = []
    for _ in range(rng.randint(0, 8)):
        k = rng.randrange(universe)
        out.append(bytes([k * 37 % 256]) + b"k%d" % k + b"\x00" * (k % 3) * 9)
    return out


def block(digest: bytes, cls: int, last_used: int) -> Block:
    b = Block(0, 0)
    b.digest, b.adaptive_class, b.last_used = digest, cls, last_used
    return b


def test_the_tables_are_the_compiled_ones():
    assert (NativeGhosts, NativeLru, NativeBands, NativeLife, NativeExact) != (
        GhostFifo, LruShadow, BandsShadow, LifeTables, ExactLru)
    assert tables(False) == (GhostFifo, LruShadow, BandsShadow, LifeTables, ExactLru)


@pytest.mark.parametrize("soon", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_ghosts_remember_forget_and_return_as_the_python_fifo(seed, soon):
    rng = random.Random(seed)
    py, nat = GhostFifo(30), NativeGhosts(30)
    for tick in range(4000):
        ks = keys(rng, 120)
        start = rng.randint(0, len(ks))
        assert nat.take(ks, start) == py.take(ks, start)
        victims = [block(k, rng.choice([-1, 3, 17, 70]), tick) for k in keys(rng, 120)]
        assert nat.add(victims, soon) == py.add(victims, soon)
        assert len(nat) == len(py) <= 30
    assert len(py) == 30  # it filled up: forgetting was compared too


def same_lookup(rng: random.Random, py, nat, ks: list[bytes]) -> None:
    """One replay of ``ks``, or one lookup with a random prefix matched and sampling rate, on both
    shadows: the same answer."""
    if rng.random() < 0.5:
        assert nat.replay(ks) == py.replay(ks)
    else:
        matched, below = rng.randint(0, len(ks)), rng.choice([1, 100, 256])
        assert nat.lookup(ks, matched, below) == py.lookup(ks, matched, below)


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_lru_shadow_hits_and_keeps_what_the_python_one_does(seed, timed):
    rng = random.Random(seed)
    py, nat = LruShadow(25, timed=timed), NativeLru(25, timed=timed)
    for step in range(4000):
        py.now = nat.now = float(step // 3)
        same_lookup(rng, py, nat, keys(rng, 80))
        assert (len(nat), nat.horizon) == (len(py), py.horizon)
    assert len(py) == 25 and (py.horizon > 0) == timed


@pytest.mark.parametrize("seed", range(4))
def test_the_bands_shadow_hits_and_keeps_what_the_python_one_does(seed):
    rng = random.Random(seed)
    py, nat = BandsShadow(20, 40), NativeBands(20, 40)
    for _ in range(4000):
        same_lookup(rng, py, nat, keys(rng, 100))
        assert (len(nat), nat.num_ghosts) == (len(py), py.num_ghosts)
    assert len(py) == 20 and py.num_ghosts == 40


BANDS = [-1] * 34 + [1, 0, 1] + [-1] * 64  # 34, 35, 36 as the adaptive policy maps them


def life_state(t) -> tuple:
    return ([list(r) for r in t.hits], [list(r) for r in t.ends], list(t.starts), [list(c) for c in t.counts],
            [list(r) for r in t.p])


@pytest.mark.parametrize("seed", range(6))
def test_the_life_tables_count_and_estimate_what_the_python_ones_do(seed):
    rng = random.Random(seed)
    # small prior and fading, cohorts of a few ticks: estimates move, counts halve, cohorts merge
    args = (rng.choice([0.0, 3.0, 800.0]), rng.choice([7, 50, 4096]), rng.choice([1, 4, 16]), BANDS)
    py, nat = LifeTables(*args), NativeLife(*args)
    tick = 0
    prios = (34, 35, 36, 5, 100)
    for step in range(3000):
        op = rng.randrange(9)
        if op == 0:  # a release: blocks become evictable from the next tick on
            r, f = rng.randint(0, 6), rng.randint(0, 6)
            for t in (py, nat):
                t.arrive(r, f, tick + 1)
            tick += rng.randint(1, 12)
        elif op in (1, 2):  # one block used again or evicted, at any age (old ones too)
            band, lu = rng.randint(0, 1), rng.randint(max(0, tick - 300), tick)
            age = tick - lu if rng.random() < 0.9 else rng.randrange(1 << 40)
            for t in (py, nat):
                (t.used if op == 1 else t.evicted)(band, age, lu)
        elif op == 3:
            band, lu = rng.randint(0, 1), rng.randint(max(0, tick - 300), tick)
            for t in (py, nat):
                t.leave(band, lu)
        elif op == 4:
            old, new, lu = rng.randint(-1, 1), rng.randint(-1, 1), rng.randint(0, tick)
            for t in (py, nat):
                t.move(old, new, lu)
        elif op in (5, 6):  # a lookup's hits (only ref 1 counts), or victims in one batch or in runs
            blocks = []
            for _ in range(rng.randint(0, 40)):
                b = Block(0, 0)
                b.priority, b.ref = rng.choice(prios), rng.choice((1, 1, 1, 2))
                b.last_used = rng.randint(max(0, tick - 400), tick)
                blocks.append(b)
            if op == 5:
                for t in (py, nat):
                    t.blocks_used(blocks, tick)
            else:
                blocks.sort(key=lambda b: (b.priority, b.last_used))  # as the eviction index hands them out
                if rng.random() < 0.3:
                    for t in (py, nat):
                        t.blocks_evicted(blocks, tick)
                else:
                    runs, i = [], 0
                    while i < len(blocks):
                        j = i + rng.randint(1, 12)
                        runs.append(blocks[i:j])
                        i = j
                    for t in (py, nat):
                        t.runs_evicted(runs, tick)
        elif op == 7:
            for t in (py, nat):
                t.compute(tick)
            assert nat.alive(tick) == py.alive(tick)
        else:
            a, b = rng.randrange(2000), rng.randrange(2000)
            assert nat.frequency_first(a, b) == py.frequency_first(a, b)
        assert life_state(nat) == life_state(py), (step, op)
    ages = (1, 10, 100, 1000, 1 << 33)
    assert nat.describe(tick, ages) == py.describe(tick, ages)
    assert any(x != 1.0 for row in py.p for x in row) and len(py.starts) > 1  # it estimated and kept cohorts


def test_the_compiled_estimates_can_be_set():
    nat = NativeLife(0.0, 10, 1, BANDS)
    nat.p = [[0.2] * 64, [0.1] * 64]
    assert nat.p == [[0.2] * 64, [0.1] * 64] and nat.frequency_first(1, 100)
    with pytest.raises(IndexError, match="2 rows of 64"):
        nat.p = [[0.2] * 63, [0.1] * 64]


def test_a_digest_longer_than_32_bytes_is_refused():
    with pytest.raises(ValueError, match="33 bytes"):
        NativeLru(4).replay([b"x" * 33])


def run(policy: AdaptivePolicy, host: int, prompts: list[Prompt]) -> tuple[list, dict]:
    """The events and the learned state of a 1,000-block cache (``host`` more on the host tier)."""
    clock = ManualClock()
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=1000, num_host_blocks=host, block_size=512, adaptive=policy,
                                       max_queued_events=1 << 30), clock=clock)
    events = []
    for i, p in enumerate(prompts):
        clock.set(i * 0.5)
        mgr.allocate("r", p)
        mgr.free("r")
        events += [(e.event_id, e.data) for e in mgr.drain_events()]
    assert mgr.adaptive is not None
    state = mgr.adaptive.describe()
    assert state.pop("tables") == ("compiled" if policy.compiled else "python")
    return events, state


@pytest.mark.parametrize(("settings", "host"), [({}, 0), ({}, 300),
                                                 ({"frequency_horizons": 2.0, "soon_share": 0.3,
                                                   "life_tables": False}, 0)],
                         ids=["default", "host_tier", "routed"])
def test_a_cache_with_either_tables_emits_the_same_events_and_learns_the_same(settings, host):
    # Multi-turn conversations on 1,000 blocks: the guard switches the bands off and on, the life
    # tables demote, ghosts return; shadows of 64 blocks sample one digest in 16.
    trace = as_trace(GENERATORS["multi_turn"](2000))
    prompts = [p for p in trace_prompts(trace) if len(p.digests) <= 1000]
    python = run(AdaptivePolicy(compiled=False, shadow_sample_blocks=64, **settings), host, prompts)
    compiled = run(AdaptivePolicy(compiled=True, shadow_sample_blocks=64, **settings), host, prompts)
    assert compiled == python
    state = python[1]
    assert state["switches"] >= 1 and len(python[0]) > 4000
    if not settings and not host:
        assert state["life"]["demotions"] > 1000
