"""The publisher keeps every batch under its byte limit, and a refused message never kills a node."""

from __future__ import annotations

import pytest

from eventbus import protocol as p
from eventbus.config import KafkaSettings
from eventbus.publisher import InMemorySink, KafkaSink, Publisher
from eventbus.replay import NodeState
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.kv.prompt import Prompt

pytestmark = pytest.mark.unit


def filled_core(blocks: int, part_blocks: int) -> KVCacheManager:
    core = KVCacheManager(KvCacheConfig(num_gpu_blocks=blocks, block_size=4, snapshot_part_blocks=part_blocks))
    for i in range(blocks // 8):
        core.allocate(f"r{i}", Prompt.from_tokens(list(range(i * 1000, i * 1000 + 32)), 4))
        core.free(f"r{i}")
    return core


def test_a_large_snapshot_goes_in_parts_and_batches_stay_under_the_limit():
    core = filled_core(4096, part_blocks=500)
    assert core.num_cached_blocks == 4096
    sink = InMemorySink()
    pub = Publisher(core, sink, "n", "i", max_events_per_batch=10_000, max_batch_bytes=64 * 1024)
    core.request_snapshot()
    pub.pump()
    sizes = [len(p.encode(b)) for b in sink.batches]
    assert len(sizes) > 1 and max(sizes) <= 64 * 1024
    events = [e for b in sink.batches for e in b.events]
    assert [e.event_id for e in events] == list(range(len(events)))  # in order, no gap
    snaps = [e.data for e in events if isinstance(e.data, p.Snapshot)]
    last = [s for s in snaps if s.parts == 9]  # 4096 blocks in parts of 500
    assert [s.part for s in last] == list(range(9)) and sum(len(s.blocks) for s in last) == 4096
    state = NodeState().apply_all(events)
    assert state.blocks == NodeState.from_snapshot_blocks(core.cached_blocks())


def test_a_message_kafka_refuses_counts_as_lost_and_asks_for_a_snapshot():
    # No broker needed: librdkafka refuses a message over message.max.bytes before sending it.
    sink = KafkaSink(KafkaSettings(bootstrap="localhost:1"), "n", **{"message.max.bytes": 2_000})
    try:
        core = filled_core(64, part_blocks=16_384)
        pub = Publisher(core, sink, "n", "i", max_batch_bytes=1 << 20)
        pub.pump()  # created, the first snapshot and the stored events: one batch far over 2 kB
        # Refused at produce() (counted there, not by a delivery report). NOTE: no check of
        # in_flight() here: len(producer) also counts librdkafka's own protocol requests (the
        # bootstrap attempts to localhost:1), 0-2 of them at any moment.
        assert sink.failed() == 1 and "too large" in (sink.last_error or "").lower()
        pub.pump()  # the loss is noticed: a snapshot is owed
        assert core.stats.snapshots == 2
    finally:
        sink.producer.purge()
        sink.close()


class DeliversWhenFlushed(InMemorySink):
    """librdkafka's shape: what is sent stays in flight until the producer is given time."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = True

    def flush(self, timeout: float) -> int:
        self.hold = False
        self.poll()
        self.hold = True
        return len(self.held)


def test_drain_sends_what_a_backlogged_pump_left_in_the_core():
    core = filled_core(256, part_blocks=16_384)
    queued = core.pending_events
    sink = DeliversWhenFlushed()
    pub = Publisher(core, sink, "n", "i", max_events_per_batch=2, max_in_flight=3)
    # One pump and a flush (what a stopping node did): three batches, the rest left in the core.
    pub.pump()
    assert sink.flush(1) == 0 and len(sink.batches) == 3 and core.pending_events == queued - 6
    assert pub.drain(5) == 0
    events = [e for b in sink.batches for e in b.events]
    assert core.pending_events == 0 and [e.event_id for e in events] == list(range(queued))


def test_drain_gives_up_at_its_timeout_and_says_what_is_left():
    core = filled_core(64, part_blocks=16_384)
    sink = InMemorySink()
    sink.hold = True  # a sink that never delivers (no broker)
    pub = Publisher(core, sink, "n", "i", max_events_per_batch=2, max_in_flight=3)
    assert pub.drain(0.2) == 3 and core.pending_events > 0
