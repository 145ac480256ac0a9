"""The materializer's garbage-collector tuning keeps collecting cycles, only less often."""

from __future__ import annotations

import gc
import weakref

from state_store.faust_app import GC_THRESHOLDS, tune_gc


class Node:
    pass


def test_cycles_made_after_tuning_are_still_collected_automatically():
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
        gone = weakref.ref(a)
        del a, b
        keep = [[] for _ in range(3 * GC_THRESHOLDS[0])]  # tracked allocations, no explicit collect()
        assert gone() is None
        del keep
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
