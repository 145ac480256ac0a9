"""The KV core decides, emits and ends exactly as it did before its eviction policy moved behind
:class:`~inference_node.kv.policy.EvictionPolicy`: the conversation trace and every generated
family, in ten settings (plain LRU, client priorities with durations, host tiers, the adaptive
policy with compiled and Python tables, routed settings, caches too small for some requests),
give the digests recorded with the earlier core (``replay_golden.json``; how:
``replay_equivalence.py``). One digest was recorded again since, on purpose: agentic in the tight
adaptive setting (160 blocks), where the floor against LRU (2026-12-07, ``inference_node/kv/floor.py``)
engages — with ``floor=False`` that replay still gives the old digest. The floor's own counters are
left out of the learned state that is hashed. The adaptive settings replay the ghost window they
were recorded with (4 caches' worth, the default until 2026-12-07; 3.5 since: ``ghost_caches``) and
without the life tables' guard (``strict_guard``, on by default since 2026-12-07)."""

from __future__ import annotations

import json

import pytest

from tests.inference_node.kv.replay_equivalence import GOLDEN, SETTINGS, cases, replay

pytestmark = pytest.mark.unit

_GOLDEN: dict[str, dict[str, str]] = json.loads(GOLDEN.read_text())


def test_every_case_has_a_recorded_digest() -> None:
    assert sorted(cases()) == sorted((w, s) for w, by in _GOLDEN.items() for s in by)


@pytest.mark.parametrize(("workload", "setting"), cases())
def test_replay_gives_the_recorded_event_stream_and_cache(workload: str, setting: str) -> None:
    assert replay(workload, SETTINGS[setting]) == _GOLDEN[workload][setting]
