"""TensorRT-LLM through ``kvflow bridge trtllm``: events in its serializer's exact JSON shape
(``KVCacheEventSerializer``), served by a local stand-in for ``trtllm-serve``'s
``POST /kv_cache_events``, through Kafka and the materializer: its priorities and cache levels
survive into ``node_blocks``; a gap in ``event_id`` starts a new instance."""

from __future__ import annotations

import pytest

from eventbus.hashing import block_hash, chain_digests
from tests.bridge.conftest import EngineHTTP, start_bridge
from tests.support import node_row, sql_blocks, wait_for

pytestmark = pytest.mark.integration

BS = 4


def tokens(ids: list[int]) -> list[dict]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]


def stored(eid: int, parent: int | None, blocks: list[tuple[int, list[int], int, int]]) -> dict:
    return {"event_id": eid, "window_size": 4096, "data": {"type": "stored", "parent_hash": parent, "blocks": [
        {"type": "stored_block", "block_hash": h, "tokens": tokens(t), "cache_level": level, "priority": prio}
        for h, t, level, prio in blocks]}}


def kv(ids: list[int]) -> list[int]:
    return [block_hash(d) for d in chain_digests(ids, BS)]


def test_priorities_and_cache_levels_pass_through_and_a_gap_starts_a_new_instance(pipeline):
    db = pipeline["db"]
    with EngineHTTP(model="trt-model", num_gpu_blocks=32, block_size=BS) as engine:
        engine.queue({"event_id": 0, "window_size": 4096, "data": {"type": "created",
                                                                     "num_blocks_per_cache_level": [32, 64]}},
                     stored(1, None, [(101, [1, 2, 3, 4], 0, 90), (102, [5, 6, 7, 8], 0, 35)]),
                     stored(2, 102, [(103, [9, 9, 9, 9], 1, 10)]),
                     {"event_id": 3, "window_size": 4096, "data": {
                         "type": "updated", "block_hash": 102,
                         "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                         "priority": {"type": "event_diff", "new_value": 80, "old_value": 35}}},
                     {"event_id": 4, "window_size": 4096, "data": {"type": "removed", "block_hashes": [103]}},
                     {"event_id": 5, "window_size": 4096, "data": {"type": "future_kind"}})
        bridge = start_bridge(pipeline, "trtllm", "trt-0", "--engine-url", engine.url, "--block-size", str(BS))
        try:
            h = kv([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])
            want = {h[0]: (None, 0, 90), h[1]: (h[0], 1, 80)}

            def blocks() -> dict:
                return {k: (v.parent_hash, v.cache_level, v.priority) for k, v in sql_blocks(db, "trt-0").items()}

            wait_for(lambda: blocks() == want, 30, what="TensorRT-LLM's blocks in node_blocks")
            # the heartbeat (on its own topic) may be applied after the events
            row = wait_for(lambda: (r := node_row(db, "trt-0")) is not None and r["url"] is not None and r, 30,
                           what="the bridge's heartbeat")
            assert row["url"] == engine.url and row["model"] == "trt-model" and row["block_size"] == BS
            first = row["instance_id"]
            engine.queue(stored(9, None, [(201, [7, 7, 7, 7], 0, 50)]))  # ids 6..8 never came
            wait_for(lambda: blocks() == {kv([7] * 4)[0]: (None, 0, 50)}, 30, what="a new instance after the gap")
            assert node_row(db, "trt-0")["instance_id"] != first
        finally:
            bridge.stop()
        assert "future_kind" in bridge.log_path.read_text()  # counted, and logged at exit


def test_an_engine_whose_metrics_go_silent_makes_its_node_stale(pipeline):
    db = pipeline["db"]
    with EngineHTTP(model="trt-model", num_gpu_blocks=8, block_size=BS) as engine:
        bridge = start_bridge(pipeline, "trtllm", "trt-silent", "--engine-url", engine.url, "--block-size", str(BS),
                              "--num-blocks", "8")
        try:
            wait_for(lambda: (node_row(db, "trt-silent") or {}).get("status") == "live", 30, what="live")
            engine.up = False  # its HTTP server answers 503: no load, so no heartbeat
            wait_for(lambda: node_row(db, "trt-silent")["status"] == "stale", 30, what="stale after the silence")
            engine.up = True
            wait_for(lambda: node_row(db, "trt-silent")["status"] == "live", 30, what="live again")
        finally:
            bridge.stop()
