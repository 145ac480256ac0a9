"""kvflow's retention inside vLLM's real KV cache manager (vLLM 0.33.0's modules, ``make engines``):
request streams without retention evict exactly as stock vLLM (every free-block order compared
step by step), a retained system prompt survives a flood that evicts it in stock vLLM, eviction
takes the lowest priority first, durations fall back to 35, a shared block keeps the highest
claim, and the plugin leaves vLLM alone on a version it was not tested with."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.bridge.engines import require

BS = 16


@pytest.fixture(scope="module")
def vllm_kv():
    require("vllm")
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BS, hash_fn)


@pytest.fixture
def plugin(vllm_kv):
    from kvflow_vllm import hooks

    hooks.patch()
    yield hooks
    hooks.unpatch()


def manager(num_blocks: int) -> Any:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                          enable_caching=True, enable_kv_cache_events=True)


def request(hasher: Any, rid: str, tokens: list[int], retention: dict | str | None = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = None if retention is None else {"kv_retention": retention if isinstance(retention, str)
                                            else json.dumps(retention)}
    return Request(rid, tokens, SamplingParams(max_tokens=1, extra_args=extra), None, block_hasher=hasher)


def run(mgr: Any, req: Any, free: bool = True) -> int:
    """A prefill as vLLM's scheduler runs it: lookup, slots (None: out of blocks), then free."""
    from vllm.v1.request import RequestStatus

    mgr.new_step_starts()
    computed, hit, _ = mgr.get_computed_blocks(req)
    if mgr.allocate_slots(req, req.num_tokens - hit, hit, computed) is None:
        return -1
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens
    if free:
        mgr.free(req)
    return hit


def free_order(mgr: Any) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def test_without_retention_every_free_block_order_is_stock_vllms(vllm_kv):
    from kvflow_vllm import hooks

    stock = manager(40)
    hooks.patch()
    try:
        ours = manager(40)
        assert getattr(ours.block_pool.free_block_queue, "kvflow_retention", False)
        rng = random.Random(7)
        prefixes = [[rng.randrange(1, 30_000) for _ in range(rng.choice((16, 32, 48, 80)))] for _ in range(6)]
        live: list[tuple[Any, Any]] = []
        for i in range(400):
            if live and (rng.random() < 0.45 or len(live) > 3):  # finish one in flight
                a, b = live.pop(rng.randrange(len(live)))
                stock.free(a)
                ours.free(b)
            else:
                tokens = rng.choice(prefixes) + [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 70))]
                a, b = request(vllm_kv, f"s{i}", tokens), request(vllm_kv, f"o{i}", tokens)
                hits = run(stock, a, free=False), run(ours, b, free=False)
                assert hits[0] == hits[1], i
                if hits[0] >= 0:
                    live.append((a, b))
            assert free_order(stock) == free_order(ours), i
            assert stock.block_pool.get_num_free_blocks() == ours.block_pool.get_num_free_blocks()
    finally:
        hooks.unpatch()


SYSTEM = list(range(100, 100 + 64))  # 4 blocks


def flood(mgr: Any, hasher: Any, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for i in range(n):
        assert run(mgr, request(hasher, f"flood-{seed}-{i}", [rng.randrange(1, 30_000) for _ in range(5 * BS)])) >= 0


def test_a_retained_system_prompt_survives_a_flood_that_evicts_it_in_stock_vllm(vllm_kv, plugin):
    keep = {"token_ranges": [{"start": 0, "end": len(SYSTEM), "priority": 100, "duration_s": None}]}
    for retained, want in ((keep, len(SYSTEM)), (None, 0)):
        mgr = manager(17)  # 16 usable blocks: the flood's 5-block prompts cycle through all of them
        assert run(mgr, request(vllm_kv, "first", SYSTEM + [7, 8, 9], retained)) == 0
        flood(mgr, vllm_kv, 12)
        assert run(mgr, request(vllm_kv, "again", SYSTEM + [10, 11])) == want


def test_eviction_takes_the_lowest_priority_first_then_the_least_recently_freed(vllm_kv, plugin):
    mgr = manager(17)
    prompts = {p: [p * 1000 + t for t in range(2 * BS)] for p in (10, 60, 35)}
    for p, tokens in prompts.items():  # freed in this order: 10, 60, 35
        retention = None if p == 35 else {"token_ranges": [{"start": 0, "end": None, "priority": p}]}
        run(mgr, request(vllm_kv, f"p{p}", tokens + [1], retention))
    queue = mgr.block_pool.free_block_queue
    cached = {p: [mgr.block_pool.blocks[b.block_id] for b in queue.get_all_free_blocks()] for p in prompts}
    assert cached  # the order: never-used blocks, then priority 10's, 35's, 60's
    order = [queue.retention(b)[0] for b in queue.get_all_free_blocks() if b.block_hash is not None]
    assert order == sorted(order) and order[0] == 10 and order[-1] == 60
    flood(mgr, vllm_kv, 3, seed=1)  # 15 blocks wanted: the 10 and the 35 go, the 60 stays
    assert [run(mgr, request(vllm_kv, f"again{p}", prompts[p] + [2])) for p in (10, 35, 60)] == [0, 0, 2 * BS]


def test_a_duration_falls_back_to_35_and_a_shared_block_keeps_the_highest_claim(vllm_kv, plugin):
    now = [0.0]
    mgr = manager(17)
    queue = mgr.block_pool.free_block_queue
    queue._policy._clock = lambda: now[0]
    tokens = list(range(500, 500 + 2 * BS)) + [1]
    run(mgr, request(vllm_kv, "a", tokens, {"token_ranges": [{"start": 0, "end": None, "priority": 90,
                                                               "duration_s": 5}]}))
    block = next(b for b in queue.get_all_free_blocks() if b.block_hash is not None)
    assert queue.retention(block) == (90, 5.0)
    run(mgr, request(vllm_kv, "b", tokens, {"token_ranges": [{"start": 0, "end": None, "priority": 20}]}))
    assert queue.retention(block) == (90, 5.0)  # a lower claim does not lower it
    run(mgr, request(vllm_kv, "c", tokens))  # no retention: no claim
    assert queue.retention(block) == (90, 5.0)
    now[0] = 6.0
    queue.get_all_free_blocks()  # the clock is read when the order is
    assert queue.retention(block) == (35, None) and (block.block_id, 90, 35) in queue.changed
    run(mgr, request(vllm_kv, "d", tokens, {"token_ranges": [{"start": 0, "end": None, "priority": 100}]}))
    assert queue.retention(block) == (100, None)


def test_a_retention_that_cannot_be_read_is_ignored_and_logged(vllm_kv, plugin, caplog):
    mgr = manager(17)
    with caplog.at_level("WARNING", logger="vllm.kvflow"):
        bad = '{"token_ranges": [{"start": 0, "priority": 101}]}'
        run(mgr, request(vllm_kv, "bad", list(range(2 * BS)) + [1], bad))
    assert "vllm_xargs.kv_retention ignored" in caplog.text and "101" in caplog.text
    queue = mgr.block_pool.free_block_queue
    assert {queue.retention(b) for b in queue.get_all_free_blocks()} == {(35, None)}


def test_the_plugin_leaves_an_untested_vllm_version_alone(vllm_kv, monkeypatch, caplog):
    import vllm
    import vllm.v1.core.block_pool as block_pool

    import kvflow_vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(kvflow_vllm, "_state", {"registered": False, "reason": None})
    before = block_pool.FreeKVCacheBlockQueue
    with caplog.at_level("WARNING", logger="vllm.kvflow"):
        kvflow_vllm.register()
    assert block_pool.FreeKVCacheBlockQueue is before
    assert "NOT active: vLLM 0.99.0 is not one of the versions tested" in caplog.text
    assert kvflow_vllm.status()["registered"] is False


def test_the_plugin_imports_kvflows_pure_kv_core_only():
    """Loaded inside vLLM's processes: no torch, no model, no HTTP of kvflow's."""
    import subprocess
    import sys

    code = ("import sys, kvflow_vllm, kvflow_vllm.queue, kvflow_vllm.hooks; "
            "mods = [m for m in sys.modules if m.split('.')[0] in ('inference_node', 'openai_api', 'torch')]; "
            "print(sorted(m for m in mods if not m.startswith('inference_node.kv') and m != 'inference_node'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_stored_events_carry_each_blocks_priority_for_vllms_decoder_and_kvflows_bridge(vllm_kv, plugin):
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from bridge.wire import decode_payload

    mgr = manager(17)
    keep = {"token_ranges": [{"start": 0, "end": BS, "priority": 100}, {"start": BS, "end": None, "priority": 60}]}
    run(mgr, request(vllm_kv, "kept", list(range(900, 900 + 3 * BS)) + [1], keep))
    run(mgr, request(vllm_kv, "plain", list(range(700, 700 + 2 * BS)) + [1]))
    kept, plain = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    # every stored event says its priorities (35: no claim), so that a bridge sees the plugin
    assert kept.priorities == [100, 60, 60] and plain.priorities == [35, 35]
    assert not kept.priority_update and b"priority_update" not in msgspec.msgpack.encode(kept)  # a default: left out
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[kept, plain]))
    theirs = msgspec.msgpack.decode(payload, type=KVEventBatch)  # vLLM's own decoder
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored", "BlockStored"]
    assert theirs.events[0].block_hashes == kept.block_hashes
    ours = decode_payload(0, payload)  # kvflow's bridge
    assert [e.priorities for e in ours.events] == [[100, 60, 60], [35, 35]]
    assert not any(k.startswith("field:BlockStored.priorities") for k in ours.skipped)


def test_a_request_raising_the_priority_of_blocks_it_reuses_publishes_the_change_and_the_bridge_updates(
        vllm_kv, plugin):
    """A prefix stored at 35, then reused by a request that retains it at 100: the reuse is
    re-reported (vLLM's own ``emit_cached_block_events``) with ``priority_update``; vLLM's decoder
    reads a plain ``BlockStored``, kvflow's bridge turns it into ``updated`` (100), not into copies:
    one removal of each block still empties kvflow's view."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    from bridge.wire import decode_payload
    from eventbus.protocol import Updated
    from tests.bridge.test_translate import bridge, instances

    mgr = manager(9)
    prefix = list(range(300, 300 + 3 * BS))
    run(mgr, request(vllm_kv, "first", prefix + [1]))
    run(mgr, request(vllm_kv, "again", prefix + [2]))  # no retention: nothing to publish
    run(mgr, request(vllm_kv, "keep", prefix + [3], {"token_ranges": [{"start": 0, "end": None, "priority": 100}]}))
    run(mgr, request(vllm_kv, "lower", prefix + [4], {"token_ranges": [{"start": 0, "end": None, "priority": 10}]}))
    events = mgr.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.priorities, e.priority_update) for e in stored] == [([35, 35, 35], False), ([100, 100, 100], True)]
    assert stored[1].block_hashes == stored[0].block_hashes and stored[1].parent_block_hash is None
    for i in range(5, 20):  # a flood evicts every block of the prefix
        run(mgr, request(vllm_kv, f"f{i}", list(range(10_000 * i, 10_000 * i + 7 * BS)) + [1]))
    events += mgr.take_events()
    gone = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(stored[0].block_hashes) <= gone
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    theirs = msgspec.msgpack.decode(payload, type=KVEventBatch)  # vLLM's own decoder reads every event
    assert [type(e).__name__ for e in theirs.events] == [
        "BlockStored" if isinstance(e, BlockStored) else type(e).__name__ for e in events]

    b, sink, _ = bridge()
    for seq, event in enumerate(stored):  # the store, then the update, each in a batch of its own
        b.on_batch(decode_payload(seq, msgspec.msgpack.encode(KVEventBatch(ts=1.0 + seq, events=[event]))))
        b.pump()
    (state,) = instances(sink).values()
    assert sorted(blk.priority for blk in state.blocks.values()) == [100, 100, 100]
    updates = [e.data for bt in sink.batches for e in bt.events if isinstance(e.data, Updated)]
    assert [(u.priority.old, u.priority.new) for u in updates] == [(35, 100)] * 3
    assert b.engine_name == "vllm+kvflow" and b.stats.duplicate_blocks == 0
    prefix = set(stored[0].block_hashes)
    prefix_gone = [e for e in events if isinstance(e, BlockRemoved) and set(e.block_hashes) <= prefix]
    b.on_batch(decode_payload(2, msgspec.msgpack.encode(KVEventBatch(ts=3.0, events=prefix_gone))))
    b.pump()
    assert instances(sink)[b.instance_id].blocks == {}


def test_kvflow_registers_the_plugin_on_vllms_entry_point_group():
    """What ``pip install kvflow`` gives vLLM: ``vllm.general_plugins`` → ``kvflow_retention``."""
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvflow_retention"]
    assert ep.value == "kvflow_vllm:register" and ep.dist is not None and ep.dist.name == "kvflow"
