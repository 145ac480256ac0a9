"""The life tables' guard (inference_node/kv/shadows.py ``StrictGuard``, "The life tables' guard" in
inference_node/kv/adaptive.py): strict bands once a shadow of them leads the cache, the tables again
once the cache falls behind LRU, a hold before strict bands return, and what it gains where the
tables demote blocks that pay."""

from __future__ import annotations

import pytest

from eventbus.protocol import Removed, Updated
from inference_node.kv.adaptive import FREQUENCY_PRIORITY, RECENCY_PRIORITY, AdaptivePolicy
from inference_node.kv.shadows import BandsShadow, StrictGuard
from kvflow.sim.adversarial import replay_hits
from kvflow.sim.families_extra import many_tenants

from .helpers import cache, hashes, prompt, toks
from .test_adaptive import NEVER, OFF, learner, policy, rate, two_bands

EVERY = 256  # the sampling threshold that keeps every digest


def test_strict_bands_turn_on_when_their_shadow_leads_and_wait_a_hold_after_falling_behind():
    g = StrictGuard(BandsShadow(capacity=8, ghost_capacity=8))
    a, b = b"a", b"b"
    g.step([a, b], 0, EVERY, rate=0.5, margin=0.1)  # new to the shadow too: no lead
    assert not g.on and g.lead == 0.0
    g.step([a, b], 0, EVERY, rate=0.5, margin=0.1)  # the shadow hits 2, the cache 0: lead 1.0
    assert g.on and g.switches == 1 and g.lead == 1.0
    g.off(base=4)  # strict bands fell behind LRU: a hold of 4 lookups (no earlier hold to compare)
    assert not g.on and g.hold == 4 and g.switches == 2 and g.lead == 0.0
    for _ in range(3):
        g.step([a, b], 0, EVERY, rate=0.5, margin=0.1)
        assert not g.on  # leading, but within the hold
    g.step([a, b], 0, EVERY, rate=0.5, margin=0.1)
    assert g.on and g.switches == 3
    g.off(base=4)  # a strict stretch of 0 lookups, shorter than the hold: doubled
    assert g.hold == 8
    for _ in range(8):
        g.step([a, b], 0, EVERY, rate=0.5, margin=0.1)
    assert g.on
    for _ in range(10):  # a stretch longer than the hold: the next hold is the base again
        g.step([a, b], 0, EVERY, rate=0.5, margin=0.1)
    g.off(base=4)
    assert g.hold == 4
    assert g.describe() == {"on": False, "switches": 6, "lead": 0.0, "hold": 4}


def test_behind_lru_strict_bands_give_way_to_the_tables_first_then_the_bands_to_lru():
    pol = learner(guard_rate=0.5)
    guard = pol.strict_guard
    assert guard is not None and pol.life is not None
    digests = [b"\x00x", b"\x00y"]
    pol.on_lookup(digests, matched=0, now=0.0)  # new to every shadow
    assert pol.bands and not pol.strict
    # both shadows hit what the cache is told it missed: the strict shadow leads (strict bands on),
    # and in the same lookup the cache is behind LRU: strict bands off again, held for 1 / guard_rate
    pol.on_lookup(digests, matched=0, now=0.0)
    assert pol.bands and not pol.strict and guard.switches == 2 and guard.hold == 2
    pol.on_lookup(digests, matched=0, now=0.0)  # still behind LRU, strict bands held: LRU
    assert not pol.bands and pol.revoke_due and pol.switches == 1
    assert pol.describe()["strict"] == {"on": False, "switches": 2, "lead": 1.0, "hold": 2}


def test_no_guard_without_life_tables_or_when_switched_off():
    assert learner(life_tables=False).strict_guard is None
    assert learner(strict_guard=False).strict_guard is None
    assert learner(strict_guard=False).describe()["strict"] is None


def test_with_strict_bands_the_tables_demote_nothing():
    mgr, _ = cache(6, adaptive=policy(guard_margin=OFF, life_every=NEVER))
    reused, once = two_bands(mgr)
    learned = mgr.adaptive
    assert learned is not None and learned.strict_guard is not None
    rate(learned, recency=0.5, frequency=0.1)  # the tables would demote the frequency band ...
    learned.strict_guard.on = True  # ... but strict bands hold
    mgr.drain_events()
    mgr.allocate("d", prompt(toks(100, 110, 120, 130)))  # 4 blocks, 2 free: the recency band goes
    events = [e.data for e in mgr.drain_events()]
    assert not [u for u in events if isinstance(u, Updated)]
    removed = [h for e in events if isinstance(e, Removed) for h in e.block_hashes]
    assert sorted(removed) == sorted(hashes(once))
    assert [mgr.block_info(d)["priority"] for d in reused.digests] == [FREQUENCY_PRIORITY] * 2
    assert learned.life_demotions == 0 and RECENCY_PRIORITY < FREQUENCY_PRIORITY


@pytest.mark.parametrize("compiled", [True, False])
def test_many_tenants_prefixes_in_a_small_cache_keep_their_hits(compiled):
    """Thousands of tenants' system prompts in 1,000 blocks: the tables demote the old frequency
    blocks, which pay here; strict bands keep them (docs/research/2026-12-adaptive-strict-guard.md)."""
    reqs = many_tenants(6000)
    lru = sum(replay_hits(reqs, 1000, None))
    tables = sum(replay_hits(reqs, 1000, AdaptivePolicy(strict_guard=False, compiled=compiled)))
    guarded = sum(replay_hits(reqs, 1000, AdaptivePolicy(compiled=compiled)))
    assert tables < 1.01 * lru
    assert guarded > 1.25 * lru
