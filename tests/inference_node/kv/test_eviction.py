"""EvictionIndex on its own (the methods the pool calls), and blocks in use that stay in their
eviction list (pinned)."""

from __future__ import annotations

from eventbus.hashing import block_hash
from inference_node.kv.block import GPU, HOST, IN_HEAP, IN_LIST, NOT_EVICTABLE, PARKED, Block
from inference_node.kv.eviction import EvictionIndex

from .helpers import cache, kinds, prio, prompt, toks


def _block(uid: int, priority: int = 35, parent: Block | None = None) -> Block:
    """A cached block in use by one request (as the pool makes them)."""
    b = Block(uid, slot=uid, digest=b"d%d" % uid, parent=parent, priority=priority)
    if parent is not None:
        parent.children += 1
        parent.gpu_children += 1
    return b


def _blocks(n: int, priority: int = 35) -> list[Block]:
    return [_block(uid, priority) for uid in range(1, n + 1)]


def _child(parent: Block, uid: int, priority: int = 35) -> Block:
    return _block(uid, priority, parent)


def _release(index: EvictionIndex, blocks: list[Block], tick: int) -> None:
    """The blocks' last users finish, in this order, from ``tick`` on."""
    freed: list[int] = []
    clocks: list[Block] = []
    assert index.release(blocks, tick - 1, freed, clocks) == tick - 1 + len(blocks)
    assert (freed, clocks) == ([], [])


def _take_into_use(index: EvictionIndex, blocks: list[Block]) -> None:
    """What the pool does when a request reuses evictable blocks."""
    listed = 0
    for b in blocks:
        if b.evict_state == IN_LIST:
            listed += 1
        else:
            index.discard(b)
        b.ref += 1
    index.pin_listed(listed)


def test_a_pinned_block_is_skipped_not_counted_and_returns_to_the_back():
    index = EvictionIndex(GPU)
    a, b, c = _blocks(3)
    _release(index, [a, b, c], 1)
    assert index.count == 3

    _take_into_use(index, [a])  # in use: stays in its list, pinned
    assert a.evict_state == IN_LIST and index.count == 2
    assert index.pop() is b  # a is skipped (and leaves the list)
    assert a.evict_state == NOT_EVICTABLE and index.count == 1

    _take_into_use(index, [c])
    _release(index, [a], 10)  # not in the list any more: appended
    _release(index, [c], 11)  # still in it, pinned: moved to the back
    assert (a.evict_state, c.evict_state, index.count) == (IN_LIST, IN_LIST, 2)
    assert [index.pop(), index.pop(), index.pop()] == [a, c, None]
    assert index.count == 0


def test_release_moves_a_pinned_block_and_discard_drops_it_without_counting():
    index = EvictionIndex(GPU)
    a, b, c = _blocks(3)
    _release(index, [a, b, c], 1)
    _take_into_use(index, [a, b])
    _release(index, [a], 10)  # the request that reused a ends (or could not be admitted)
    assert a.evict_state == IN_LIST and index.count == 2
    index.discard(b)  # in use, leaving its list (re-keyed): it is not counted anyway
    assert b.evict_state == NOT_EVICTABLE and index.count == 2
    assert [index.pop(), index.pop(), index.pop()] == [c, a, None]


def test_release_counts_users_frees_private_slots_and_hands_out_clocks():
    index = EvictionIndex(GPU)
    shared, timed = _block(1), _block(2)
    timed.duration = 5.0
    private = Block(3, slot=7)  # no digest: the partial tail of a prompt
    shared.ref = 2  # two requests use it
    freed: list[int] = []
    clocks: list[Block] = []
    assert index.release([private, timed, shared], 41, freed, clocks) == 42
    assert (freed, clocks, timed.last_used, shared.ref, shared.evict_state) == ([7], [timed], 42, 1, NOT_EVICTABLE)
    assert index.release([shared], 42, freed, clocks) == 43
    assert (clocks, shared.last_used, index.count) == ([timed], 43, 2)
    assert [index.pop(), index.pop()] == [timed, shared]


def test_taking_a_block_on_the_heap_into_use_discards_it():
    index = EvictionIndex(GPU)
    a, b = _blocks(2)
    _release(index, [b], 5)
    a.ref, a.last_used = 0, 1  # older than the list's tail: the heap
    index.add(a)
    assert a.evict_state == IN_HEAP and index.count == 2
    _take_into_use(index, [a])
    assert a.evict_state == NOT_EVICTABLE and index.count == 1
    assert [index.pop(), index.pop()] == [b, None]


def test_take_pops_a_run_of_the_lowest_priority_skipping_pinned_and_parking_parents():
    """A run comes from the front of the lowest priority's list; its victims leave the cache."""
    index = EvictionIndex(GPU)
    low = _blocks(4, priority=10)
    high = [_block(uid, priority=50) for uid in (11, 12)]
    _release(index, high, 1)
    _release(index, low, 3)
    _take_into_use(index, [low[1]])
    parent = low[2]
    child = _child(parent, 21, priority=80)  # parent is no leaf while its child is on the GPU
    assert index.count == 5
    assert index.take(3) == [low[0], low[3]]  # pinned low[1] dropped, parent parked; the list ran out
    assert (low[1].evict_state, parent.evict_state, index.count) == (NOT_EVICTABLE, PARKED, 3)
    assert index.take(1) == [high[0]]  # priority 10 holds only the parked parent: the next one
    assert index.take(5) == [high[1]]
    assert index.take(5) == []  # only the parked parent is left, and it is counted
    assert index.count == 1
    _release(index, [child], 10)
    assert index.take(5) == [child]  # it leaves: its parent is a leaf again, back in the order
    assert (parent.children, parent.gpu_children, parent.evict_state) == (0, 0, IN_HEAP)
    assert index.take(5) == [parent] and index.count == 0


def test_a_victim_handed_out_unparks_its_parent_and_ends_the_run():
    index = EvictionIndex(GPU)
    parent = _block(1, priority=10)
    kid = _child(parent, 2, priority=40)
    other = _block(3, priority=40)
    _release(index, [parent], 1)  # released first: at the front of priority 10
    assert index.take(1) == []  # parked: its child is on the GPU; nothing else is evictable yet
    _release(index, [kid, other], 2)
    assert index.take(2) == [kid]  # the parent is a leaf now, back in the order: the run stops
    assert (parent.children, parent.gpu_children) == (0, 0)
    assert index.take(2) == [parent]  # priority 10 before other's 40
    assert index.take(2) == [other]


def test_a_parent_behind_its_child_in_the_same_run_is_taken_after_it():
    index = EvictionIndex(GPU)
    head = _block(1)
    tail = _child(head, 2)
    _release(index, [tail, head], 1)  # a request's blocks are released tail first
    assert index.take(5) == [tail, head]  # once the tail is gone, the head is a leaf: one run


def test_the_host_tier_unparks_only_its_own_blocks():
    host = EvictionIndex(HOST)
    gpu_parent = _block(1)  # on the GPU, parked in the GPU's order (not this one)
    gpu_parent.evict_state = PARKED
    child = _child(gpu_parent, 2)
    gpu_parent.gpu_children = 0
    child.level = HOST
    _release(host, [child], 1)
    assert host.take(1) == [child]
    assert (gpu_parent.children, gpu_parent.evict_state, host.count) == (0, PARKED, 0)


def test_take_compares_the_heap_and_the_list_one_victim_at_a_time():
    index = EvictionIndex(GPU)
    a, b, c = _blocks(3)
    _release(index, [b, c], 5)
    a.ref, a.last_used = 0, 1  # re-entered at an older position: the heap
    index.add(a)
    assert index.take(3) == [a]  # the older front, alone
    assert index.take(3) == [b, c]  # the heap is empty again: a run


def test_the_host_tier_counts_every_child_and_the_gpu_tier_only_gpu_children():
    gpu, host = EvictionIndex(GPU), EvictionIndex(HOST)
    parent = Block(1, slot=1)
    parent.children, parent.gpu_children = 1, 0  # its one child is on the host
    assert gpu.is_leaf(parent) and not host.is_leaf(parent)


def test_rekey_moves_an_evictable_block_and_only_unlists_a_pinned_one():
    index = EvictionIndex(GPU)
    a, b, c = _blocks(3)
    _release(index, [a, b, c], 1)
    index.rekey(a, 90)  # evictable: it moves behind the 35s
    _take_into_use(index, [b])
    index.rekey(b, 10)  # in use: it only leaves its list (its release puts it back)
    assert (a.priority, a.evict_state, b.priority, b.evict_state) == (90, IN_LIST, 10, NOT_EVICTABLE)
    assert [index.pop(), index.pop(), index.pop()] == [c, a, None]


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
