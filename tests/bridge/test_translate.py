"""The bridge's pure parts: the engines' wire decoded (maps and arrays, both hash kinds, unknown
things skipped), the translation into kvflow events (digests from tokens, parents, removals,
tiers, duplicates, salts kvflow cannot see), and the sequencing of batches (replay, restarts,
gaps) — each checked by replaying the published events with ``eventbus.replay.NodeState``."""

from __future__ import annotations

import msgspec
import pytest

from bridge.engine_http import EngineClient, EngineLoad
from bridge.service import Bridge, BridgeSettings, lora_id_of
from bridge.translate import Translator
from bridge.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineBatch, WireError, decode_frames
from eventbus.hashing import block_hash, chain_digests
from eventbus.publisher import InMemorySink
from eventbus.replay import NodeState

pytestmark = pytest.mark.unit

BS = 4


def kv(tokens: list[int], lora_id: int | None = None, salt: str | None = None) -> list[int]:
    """kvflow's wire hashes of a token sequence's full blocks."""
    return [block_hash(d) for d in chain_digests(tokens, BS, lora_id=lora_id, cache_salt=salt)]


def frames(seq: int, events: list, ts: float = 1.0) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([ts, events, 0])]


def stored_map(hashes, parent, tokens, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def test_maps_and_positional_arrays_decode_alike_and_unknown_things_are_counted():
    as_map = stored_map([1, 2], None, list(range(8)), group_idx=0, kv_cache_spec_kind="full_attention")
    as_array = ["BlockStored", [1, 2], None, list(range(8)), BS, None, "GPU"]
    batch = decode_frames(frames(3, [as_map, as_array, {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]},
                                     {"type": "Mystery", "x": 1}, ["AllBlocksCleared"], 42]))
    assert batch.seq == 3 and batch.dp_rank == 0
    assert batch.events[0] == batch.events[1] == BlockStored(block_hashes=[1, 2], parent_block_hash=None,
                                                             token_ids=list(range(8)), block_size=BS, medium="GPU")
    assert batch.events[2] == BlockRemoved(block_hashes=[b"\x01" * 32])
    assert batch.events[3] == AllBlocksCleared()
    assert batch.skipped == {"field:BlockStored.group_idx": 1, "field:BlockStored.kv_cache_spec_kind": 1,
                             "type:Mystery": 1, "type:?": 1}
    for bad in ([b"", b"\x00" * 7, b""], [b"x"], [b"", b"", b"", b""]):
        with pytest.raises(WireError):
            decode_frames(bad)
    for junk in (b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode(["x", 42, None])):
        # under a good seq: a batch without events (its seq came: no gap), counted as garbage
        assert decode_frames([b"", (9).to_bytes(8, "big"), junk]) == EngineBatch(9, 0.0, [], None, {"garbage": 1})


def drained(t: Translator) -> NodeState:
    return NodeState().apply_all(t.drain_events())


def test_blocks_get_kvflow_digests_from_their_tokens_chained_on_the_parent():
    t = Translator(num_blocks=[64, 0])
    tokens = list(range(12))
    t.stored([-5, 7], None, tokens[0:8], BS)  # signed and unsigned engine hashes alike
    t.stored([9], 7, tokens[8:12], BS, level=0)
    state = drained(t)
    want = kv(tokens)
    assert list(state.blocks) == want and state.blocks[want[2]].parent_hash == want[1]
    assert state.capacity == (64, 0)
    t.removed([7, 12345])  # one known, one never seen
    assert set(drained_more(t, state).blocks) == {want[0], want[2]}  # a parent may go before its child
    assert t.stats.unknown_removed_blocks == 1 and not t.partial


def drained_more(t: Translator, state: NodeState) -> NodeState:
    return state.apply_all(t.drain_events())


def test_what_cannot_be_translated_is_skipped_counted_and_makes_the_view_partial():
    t = Translator(num_blocks=[64, 0])
    t.stored([1], 99, [1, 2, 3, 4], BS)  # the parent was never seen
    t.stored([2, 3], None, [1, 2, 3, 4, 5, 6], BS)  # a short block
    assert drained(t).blocks == {} and t.partial
    assert (t.stats.unknown_parent_blocks, t.stats.untranslatable_blocks) == (1, 2)


def test_duplicates_salts_kvflow_cannot_see_and_tiers():
    t = Translator(num_blocks=[64, 16])
    t.stored([1], None, [1, 2, 3, 4], BS)
    t.stored([1], None, [1, 2, 3, 4], BS)  # a second copy (vLLM recomputes a fully cached prompt's last block)
    t.stored([2], None, [1, 2, 3, 4], BS)  # the same tokens under another engine hash (a salt we do not see)
    t.stored([1], None, [1, 2, 3, 4], BS, level=1)  # offloaded: a copy on the host too
    state = drained(t)
    (h,) = kv([1, 2, 3, 4])
    assert list(state.blocks) == [h] and state.blocks[h].cache_level == 0 and t.stats.duplicate_blocks == 1
    t.removed([1])  # one GPU copy of engine hash 1 goes: the other stays
    t.removed([1])  # now hash 1's GPU copies are gone; hash 2 still holds the block on the GPU
    assert drained_more(t, state).blocks[h].cache_level == 0
    t.removed([2])  # only the host copy is left: the block moves to level 1
    state = drained_more(t, state)
    assert state.blocks[h].cache_level == 1
    t.removed([1], level=1)
    assert drained_more(t, state).blocks == {}


def test_a_snapshot_is_what_the_translator_holds_parents_first():
    t = Translator(num_blocks=[64, 0])
    t.stored([1, 2, 3], None, [1] * 4 + [2] * 4 + [3] * 4, BS)
    t.removed([1])
    t.stored([1], None, [1] * 4, BS)  # the parent comes back after its children
    state = drained(t)
    t.request_snapshot()
    snap = NodeState().apply_all(t.drain_events())
    assert snap.blocks == state.blocks


def test_lora_and_salt_enter_the_digest():
    t = Translator(num_blocks=[8, 0])
    t.stored([1], None, [1, 2, 3, 4], BS, lora_id=7, cache_salt="acme")
    assert list(drained(t).blocks) == kv([1, 2, 3, 4], lora_id=7, salt="acme")
    named = BlockStored(block_hashes=[1], token_ids=[1, 2, 3, 4], block_size=BS, lora_name="adapterA")
    assert lora_id_of(named) == lora_id_of(named) and 0 <= lora_id_of(named) < 1 << 63
    assert lora_id_of(BlockStored(block_hashes=[1], token_ids=[], block_size=BS, lora_id=3)) == 3


class FakeSource:
    """A replay socket holding ``held`` batches (seq → events)."""

    replay_url = "tcp://replay"

    def __init__(self, held: dict[int, list]) -> None:
        self.held = held
        self.asked: list[int] = []
        self.garbage = self.replays = self.replayed_batches = 0

    def replay(self, start: int) -> tuple[list[EngineBatch], bool]:
        self.asked.append(start)
        return [batch(s, ev) for s, ev in sorted(self.held.items()) if s >= start], True


def batch(seq: int, events: list, ts: float = 1.0) -> EngineBatch:
    return decode_frames(frames(seq, events, ts))


def bridge(held: dict[int, list] | None = None) -> tuple[Bridge, InMemorySink, FakeSource]:
    sink = InMemorySink()
    source = FakeSource(held or {})
    b = Bridge(BridgeSettings(node_id="eng-a", num_blocks=64, block_size=BS), sink,
               EngineClient("vllm", "http://127.0.0.1:1"), source)  # type: ignore[arg-type]
    return b, sink, source


def instances(sink: InMemorySink) -> dict[str, NodeState]:
    out: dict[str, NodeState] = {}
    for bt in sink.batches:
        out.setdefault(bt.instance_id, NodeState()).apply_all(bt.events)
    return out


def test_a_late_attach_is_exact_when_the_replay_holds_the_history_and_partial_otherwise():
    s0 = [stored_map([1], None, [1, 2, 3, 4])]
    s1 = [stored_map([2], 1, [5, 6, 7, 8])]
    b, sink, source = bridge({0: s0, 1: s1})
    b.on_batch(batch(2, [stored_map([3], 2, [9, 9, 9, 9])]))
    b.pump()
    (state,) = instances(sink).values()
    assert source.asked == [0] and list(state.blocks) == kv([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]) and not b.partial
    b, sink, source = bridge({1: s1})  # seq 0 has left the replay buffer
    b.on_batch(batch(2, [stored_map([3], 2, [9, 9, 9, 9])]))
    b.pump()
    (state,) = instances(sink).values()
    assert state.blocks == {} and b.partial  # block 2's parent 1 is unknown, and so is 3's parent 2


def test_gaps_are_healed_by_replay_else_a_new_partial_instance_and_restarts_start_an_exact_one():
    b, sink, source = bridge({1: [stored_map([2], 1, [5, 6, 7, 8])]})
    b.on_batch(batch(0, [stored_map([1], None, [1, 2, 3, 4])]))
    b.on_batch(batch(2, [{"type": "BlockRemoved", "block_hashes": [1]}]))  # seq 1 skipped: replayed
    b.pump()
    (first,) = instances(sink)
    assert list(instances(sink)[first].blocks) == kv([1, 2, 3, 4, 5, 6, 7, 8])[1:] and source.asked == [1]
    b.on_batch(batch(5, [stored_map([7], None, [7] * 4)]))  # 3 and 4 are not in the replay: lost
    b.on_batch(batch(6, [stored_map([8], 2, [8] * 4)]))  # its parent belonged to the dropped instance
    b.pump()
    second = [i for i in instances(sink) if i != first]
    assert len(second) == 1 and list(instances(sink)[second[0]].blocks) == kv([7] * 4) and b.partial
    b.on_batch(batch(2, [stored_map([7], None, [7] * 4)]))  # seen already (same seq and time): dropped
    b.on_batch(batch(0, [stored_map([1], None, [1, 2, 3, 4])], ts=2.0))  # the engine restarted: seq 0 again
    b.on_batch(batch(1, [{"type": "AllBlocksCleared"}, stored_map([5], None, [5] * 4)], ts=2.0))
    b.pump()
    assert b.instances == 4 and not b.partial and b.resets == {
        "gap not filled by replay": 1, "engine restarted": 1, "AllBlocksCleared": 1}
    assert list(instances(sink)[b.instance_id].blocks) == kv([5] * 4)


VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="2048"} 1.0
"""


def test_heartbeats_come_from_the_engines_metrics():
    load = EngineLoad.parse("vllm", VLLM_METRICS)
    assert load == EngineLoad(running=3, waiting=2, usage=0.25, num_gpu_blocks=2048, block_size=16)
    sglang = EngineLoad.parse("sglang", "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 4\n"
                                        "# TYPE sglang:token_usage gauge\nsglang:token_usage 0.5\n"
                                        "# TYPE sglang:max_total_num_tokens gauge\n"
                                        "sglang:max_total_num_tokens 4096\n", page_size=16)
    assert sglang == EngineLoad(running=4, usage=0.5, num_gpu_blocks=256, block_size=16)
    b, _sink, _ = bridge()
    b.s.num_blocks = None
    b.load = load
    b.model = "m"
    st = b.node_stats(load)
    assert st is not None and (st.capacity, st.active_requests, st.queued_requests, st.active_blocks) == (
        [2048, 0], 3, 2, 512)
    assert st.block_size == BS and st.url == "http://127.0.0.1:8000" and st.model == "m"


def test_at_start_the_bridge_takes_what_the_replay_holds_and_drops_live_duplicates_of_it():
    s0, s1 = [stored_map([1], None, [1, 2, 3, 4])], [stored_map([2], 1, [5, 6, 7, 8])]
    b, sink, _source = bridge({0: s0, 1: s1})
    b.attach()  # an idle engine with history: known before any live batch
    b.on_batch(batch(1, s1))  # published while the replay answered: the same batch, dropped
    b.pump()
    (state,) = instances(sink).values()
    assert list(state.blocks) == kv([1, 2, 3, 4, 5, 6, 7, 8]) and not b.partial and b.expected == 2
    b, sink, _ = bridge({1: s1})  # seq 0 is gone from the buffer: partial
    b.attach()
    assert b.partial and b.expected == 2


def test_a_publisher_that_came_back_is_asked_what_the_sub_missed_and_a_restart_is_told_apart():
    s0, s1 = [stored_map([1], None, [1, 2, 3, 4])], [stored_map([2], 1, [5, 6, 7, 8])]
    b, sink, source = bridge()
    b.on_batch(batch(0, s0))
    source.held = {0: s0, 1: s1}  # the same publisher: seq 1 went out while the SUB reconnected
    b.reconnected()
    assert b.expected == 2 and b.instances == 1
    source.held = {0: [stored_map([9], None, [9] * 4)]}  # a restarted one: it has published only seq 0 since
    b.reconnected()
    b.pump()
    assert b.instances == 2 and b.resets == {"engine restarted": 1} and b.expected == 1
    assert list(instances(sink)[b.instance_id].blocks) == kv([9] * 4)


def test_per_block_priorities_of_vllm_with_kvflows_plugin_are_read_and_checked():
    from bridge.service import _priorities

    tokens = list(range(8))
    batch = decode_frames(frames(1, [stored_map([1, 2], None, tokens, priorities=[100, 60]),
                                     stored_map([3], None, tokens[:4], priorities=["high"]),
                                     stored_map([4, 5], None, tokens, priorities=[100])]))
    assert [e.priorities for e in batch.events] == [[100, 60], ["high"], [100]] and not batch.skipped
    assert [_priorities(e) for e in batch.events] == [[100, 60], None, None]  # bad type, wrong length
    assert _priorities(BlockStored(block_hashes=[1], token_ids=tokens[:4], block_size=BS, priorities=[101])) is None
    t = Translator(num_blocks=[64, 0])
    t.stored([1, 2], None, tokens, BS, priorities=_priorities(batch.events[0]))
    state = drained(t)
    assert sorted(b.priority for b in state.blocks.values()) == [60, 100]
