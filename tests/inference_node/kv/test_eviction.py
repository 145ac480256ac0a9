"""EvictionIndex on its own, and blocks in use that stay in their eviction list (pinned)."""

from __future__ import annotations

from eventbus.hashing import block_hash
from inference_node.kv.eviction import IN_HEAP, IN_LIST, NOT_EVICTABLE, PINNED, EvictionIndex
from inference_node.kv.manager import Block

from .helpers import cache, kinds, prio, prompt, toks


def _blocks(n: int, priority: int = 35) -> list[Block]:
    return [Block(uid, slot=uid, priority=priority) for uid in range(1, n + 1)]


def _release(index: EvictionIndex, blocks: list[Block], start: int) -> None:
    for i, b in enumerate(blocks):
        b.last_used = start + i
    index.add_released(blocks)


def _leaf(b: Block) -> bool:
    return b.gpu_children == 0


def test_a_pinned_block_is_skipped_not_counted_and_returns_to_the_back():
    index = EvictionIndex(_leaf)
    a, b, c = _blocks(3)
    _release(index, [a, b, c], 1)
    assert index.count == 3

    index.pin(a)  # in use: stays in its list, pinned
    assert a.cand == PINNED and index.count == 2
    assert index.pop() is b  # a is skipped (and leaves the list)
    assert a.cand == NOT_EVICTABLE and index.count == 1

    index.pin(c)
    a.last_used, c.last_used = 10, 11
    index.add_released([a])  # not in the list any more: appended
    index.add_released([c])  # still in it, pinned: moved to the back
    assert (a.cand, c.cand, index.count) == (IN_LIST, IN_LIST, 2)
    assert [index.pop(), index.pop(), index.pop()] == [a, c, None]
    assert index.count == 0


def test_add_moves_a_pinned_block_and_discard_drops_it_without_counting():
    index = EvictionIndex(_leaf)
    a, b, c = _blocks(3)
    _release(index, [a, b, c], 1)
    index.pin(a)
    index.pin(b)
    a.last_used = 10
    index.add(a)  # a release through add (e.g. a request that could not be admitted)
    assert a.cand == IN_LIST and index.count == 2
    index.discard(b)  # re-keyed while in use: it only leaves its list
    assert b.cand == NOT_EVICTABLE and index.count == 2
    assert [index.pop(), index.pop(), index.pop()] == [c, a, None]


def test_pin_of_a_block_on_the_heap_discards_it():
    index = EvictionIndex(_leaf)
    a, b = _blocks(2)
    _release(index, [b], 5)
    a.last_used = 1  # older than the list's tail: the heap
    index.add(a)
    assert a.cand == IN_HEAP and index.count == 2
    index.pin(a)
    assert a.cand == NOT_EVICTABLE and index.count == 1
    assert [index.pop(), index.pop()] == [b, None]


def test_a_block_in_use_at_the_front_of_its_list_is_never_evicted_and_is_newest_when_released():
    mgr, _ = cache(gpu=4)
    first, second = prompt(toks(0)), prompt(toks(10))
    mgr.allocate("a", first)
    mgr.allocate("b", second)
    mgr.free("a")
    mgr.free("b")  # order: first, second
    mgr.allocate("a2", first)  # first in use again, still at the front of its list
    mgr.allocate("c", prompt(toks(20, 30)))  # fills the cache
    mgr.free("c")
    mgr.drain_events()
    assert mgr.evictable_blocks == (3, 0)

    mgr.allocate("d", prompt(toks(40)))  # evicts `second`, the oldest evictable, not `first`
    evs = mgr.drain_events()
    assert kinds(evs) == ["removed", "stored"]
    assert evs[0].data.block_hashes == [block_hash(second.digests[0])]
    mgr.free("d")
    mgr.free("a2")  # first is now the most recently released

    c_tail = block_hash(prompt(toks(20, 30)).digests[1])
    c_head = block_hash(prompt(toks(20, 30)).digests[0])
    d_hash = block_hash(prompt(toks(40)).digests[0])
    mgr.allocate("e", prompt(toks(50, 60, 70)))
    evs = mgr.drain_events()
    assert evs[0].data.block_hashes == [c_tail, c_head, d_hash]
    assert mgr.match_prefix(first) == (1, 0)


def test_re_prioritizing_a_block_in_use_takes_it_out_of_its_old_list():
    mgr, _ = cache(gpu=3)
    shared = prompt(toks(0))
    mgr.allocate("a", shared)
    mgr.free("a")
    mgr.allocate("b", shared, prio(90))  # pinned in the list of 35, re-keyed to 90
    mgr.allocate("c", prompt(toks(10)))
    mgr.free("c")
    mgr.free("b")
    mgr.drain_events()
    mgr.allocate("d", prompt(toks(20, 30)))  # needs 2: the free slot, then the 35 before the 90
    evs = mgr.drain_events()
    assert kinds(evs) == ["removed", "stored"]
    assert evs[0].data.block_hashes == [block_hash(prompt(toks(10)).digests[0])]
    assert mgr.block_info(shared.digests[0])["priority"] == 90
