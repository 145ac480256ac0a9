"""The materializer's planning rules, exactly: idempotence, gaps, instances, net effects, history."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from eventbus import protocol as p
from state_store.apply import blocks_to_look_up, plan, ts
from state_store.plans import GONE, LIVE, RESYNCING, BlockRow, NodeRow

T0 = 1_700_000_000.0


def batch(node: str, inst: str, first_id: int, *datas: p.EventData, at: float = T0) -> p.EventBatch:
    return p.EventBatch(schema_version=1, node_id=node, instance_id=inst, ts=at,
                        events=[p.Event(event_id=first_id + i, window_size=64, data=d) for i, d in enumerate(datas)])


def stored(parent: int | None, *hashes: int, prio: int = 35) -> p.Stored:
    return p.Stored(parent_hash=parent, blocks=[p.StoredBlock(block_hash=h, num_tokens=4, priority=prio)
                                                for h in hashes])


CREATED = p.Created(num_blocks_per_cache_level=[8, 4])
EMPTY = p.Snapshot(blocks=[])


def test_a_new_node_starts_from_created_and_stores_net_blocks():
    b = batch("n", "i1", 0, CREATED, EMPTY, stored(None, 1, 2, 3), p.Removed(block_hashes=[3]))
    out = plan([b], {}, {})
    assert out.resets == {"n"}
    assert set(out.upserts) == {("n", 1), ("n", 2)}  # 3 was stored and removed in the same run
    assert out.deletes == set()
    assert out.upserts[("n", 2)].parent_hash == 1
    assert out.nodes["n"] == NodeRow("n", "i1", 3, LIVE, ts(T0), 64, 8, 4)
    kinds = [(r[2], r[3], r[4], r[5]) for r in out.history]
    assert kinds == [(0, 0, "created", None), (1, 0, "snapshot", None), (2, 0, "stored", 1), (2, 1, "stored", 2),
                     (2, 2, "stored", 3), (3, 0, "removed", 3)]
    removed = out.history[-1]
    assert removed[7] == 0 and removed[9] == 35  # old level and priority, from the block stored earlier


def test_a_redelivered_batch_changes_nothing():
    node = NodeRow("n", "i1", 5, LIVE, ts(T0))
    out = plan([batch("n", "i1", 4, stored(None, 9), stored(9, 10))], {"n": node}, {})
    assert out.counts.duplicates == 1
    assert (out.history, out.upserts, out.nodes) == ([], {}, {})


def test_a_partly_redelivered_batch_applies_only_its_new_events():
    node = NodeRow("n", "i1", 4, LIVE, ts(T0))
    out = plan([batch("n", "i1", 4, stored(None, 9), stored(9, 10))], {"n": node}, {})
    assert set(out.upserts) == {("n", 10)}
    assert [r[2] for r in out.history] == [5]
    assert out.nodes["n"].last_event_id == 5


def test_removed_and_updated_take_old_values_from_sql():
    node = NodeRow("n", "i1", 9, LIVE, ts(T0))
    then = datetime(2026, 1, 1, tzinfo=UTC)
    known = {("n", 7): BlockRow("n", 7, None, 0, 80, 4, None, 64, then, then),
             ("n", 8): BlockRow("n", 8, 7, 0, 35, 4, None, 64, then, then)}
    b = batch("n", "i1", 10, p.Updated(block_hash=7, cache_level=p.LevelDiff(old=0, new=1)),
              p.Removed(block_hashes=[8]))
    assert blocks_to_look_up([b]) == {("n", 7), ("n", 8)}
    out = plan([b], {"n": node}, known)
    assert out.deletes == {("n", 8)}
    assert out.upserts[("n", 7)] == BlockRow("n", 7, None, 1, 80, 4, None, 64, then, ts(T0))
    upd, rem = out.history
    # An offload carries no priority diff: the row has the block's priority, unchanged.
    assert (upd[4], upd[7], upd[8], upd[9], upd[10]) == ("updated", 0, 1, 80, 80)
    assert (rem[4], rem[6], rem[7], rem[9]) == ("removed", 7, 0, 35)
    assert rem[13] == then  # stored_at: the residency of the removed block starts there


def test_updated_rows_carry_the_state_before_and_after_in_both_pairs():
    """An offload has the block's priority (the evictions view groups by it); a re-prioritization
    has the block's level; a block updated twice in a run has each step's values."""
    node = NodeRow("n", "i1", 9, LIVE, ts(T0))
    then = datetime(2026, 1, 1, tzinfo=UTC)
    known = {("n", 7): BlockRow("n", 7, None, 0, 90, 4, None, 64, then, then)}
    b = batch("n", "i1", 10, p.Updated(block_hash=7, priority=p.PriorityDiff(old=90, new=35)),
              p.Updated(block_hash=7, cache_level=p.LevelDiff(old=0, new=1)),
              p.Updated(block_hash=7, cache_level=p.LevelDiff(old=1, new=0), priority=p.PriorityDiff(old=35, new=100)))
    out = plan([b], {"n": node}, known)
    assert [r[7:11] for r in out.history] == [(0, 0, 90, 35), (0, 1, 35, 35), (1, 0, 35, 100)]
    assert out.upserts[("n", 7)].priority == 100 and out.upserts[("n", 7)].cache_level == 0
    # While the node resyncs its blocks are unknown: only the event's diff.
    out = plan([batch("n", "i1", 12, p.Updated(block_hash=7, cache_level=p.LevelDiff(old=0, new=1)))],
               {"n": node}, known)
    assert out.history[0][7:11] == (0, 1, None, None)


def test_a_block_stored_and_removed_in_one_run_is_neither_written_nor_deleted():
    node = NodeRow("n", "i1", 9, LIVE, ts(T0))
    then = datetime(2026, 1, 1, tzinfo=UTC)
    known = {("n", 7): BlockRow("n", 7, None, 0, 35, 4, None, 64, then, then)}
    out = plan([batch("n", "i1", 10, stored(7, 8, 9), p.Removed(block_hashes=[9, 8, 7]), stored(None, 8))],
               {"n": node}, known)
    assert out.deletes == {("n", 7)}  # only what SQL holds
    assert set(out.upserts) == {("n", 8)}  # stored again after its removal
    assert [r[4] for r in out.history] == ["stored", "stored", "removed", "removed", "removed", "stored"]


def test_a_snapshot_keeps_the_stored_time_of_blocks_it_reasserts():
    then = datetime(2026, 1, 1, tzinfo=UTC)
    node = NodeRow("n", "i1", 9, LIVE, ts(T0))
    known = {("n", 7): BlockRow("n", 7, None, 0, 80, 4, None, 64, then, then)}
    snap = p.Snapshot(blocks=[p.SnapshotBlock(block_hash=7, parent_hash=None, num_tokens=4, priority=80),
                              p.SnapshotBlock(block_hash=8, parent_hash=7, num_tokens=4, priority=35)])
    out = plan([batch("n", "i1", 10, snap)], {"n": node}, known)
    assert out.upserts[("n", 7)].stored_at == then
    assert out.upserts[("n", 8)].stored_at == ts(T0)


def test_a_gap_marks_the_node_resyncing_until_a_snapshot_heals_it():
    node = NodeRow("n", "i1", 3, LIVE, ts(T0))
    gap = batch("n", "i1", 7, stored(None, 5))
    out = plan([gap], {"n": node}, {})
    assert out.nodes["n"].status == RESYNCING and out.nodes["n"].last_event_id == 7
    assert out.resync == {"n"} and out.counts.gaps == 1
    assert out.upserts == {}  # not applied ...
    assert [r[4] for r in out.history] == ["stored"]  # ... but recorded

    heal = batch("n", "i1", 8, stored(None, 6),
                 p.Snapshot(blocks=[p.SnapshotBlock(block_hash=5, parent_hash=None, num_tokens=4, priority=50)]))
    out = plan([heal], {"n": out.nodes["n"]}, {})
    assert out.nodes["n"].status == LIVE
    assert out.resets == {"n"} and set(out.upserts) == {("n", 5)}
    assert out.resync == set()


def test_a_gap_healed_in_the_same_run_asks_for_nothing():
    node = NodeRow("n", "i1", 3, LIVE, ts(T0))
    out = plan([batch("n", "i1", 9, EMPTY, stored(None, 1))], {"n": node}, {})
    assert out.nodes["n"].status == LIVE and out.resync == set()
    assert set(out.upserts) == {("n", 1)}


def test_a_new_instance_resets_the_node_and_an_older_one_is_a_stale_replay():
    node = NodeRow("n", "old", 40, LIVE, ts(T0))
    restart = batch("n", "new", 0, CREATED, EMPTY, stored(None, 1), at=T0 + 10)
    out = plan([restart], {"n": node}, {("n", 99): BlockRow("n", 99, None, 0, 35, 4, None, 64, ts(T0), ts(T0))})
    assert out.resets == {"n"} and out.counts.new_instances == 1
    assert out.nodes["n"].instance_id == "new" and out.nodes["n"].last_event_id == 2

    late = batch("n", "old", 41, p.Removed(block_hashes=[99]), at=T0 + 5)
    out2 = plan([late], {"n": out.nodes["n"]}, {})
    assert out2.counts.stale_replays == 1 and out2.history == [] and out2.nodes == {}


def test_an_unknown_instance_starting_mid_stream_is_a_gap():
    out = plan([batch("n", "mystery", 57, stored(None, 1))], {}, {})
    assert out.nodes["n"].status == RESYNCING and out.resync == {"n"}
    assert out.resets == {"n"} and out.upserts == {}


def test_events_that_contradict_sql_ask_for_a_resync():
    node = NodeRow("n", "i1", 0, LIVE, ts(T0))
    out = plan([batch("n", "i1", 1, p.Removed(block_hashes=[12345]))], {"n": node}, {})
    assert out.counts.anomalies == 1 and out.resync == {"n"}
    assert out.nodes["n"].status == RESYNCING


def test_sql_hashes_are_signed():
    big = (1 << 64) - 5
    out = plan([batch("n", "i", 0, CREATED, stored(None, big))], {}, {})
    assert list(out.upserts) == [("n", -5)]


def test_an_events_hashes_convert_to_sql_as_each_one_does():
    hashes = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    assert p.to_sql_list(hashes) == [p.to_sql(h) for h in hashes] == [0, 1, (1 << 63) - 1, -(1 << 63), -1]
    assert [p.from_sql(v) for v in p.to_sql_list(hashes)] == hashes


def test_a_node_that_said_goodbye_stays_gone_and_its_late_events_are_history_only():
    """Its stopping heartbeat was consumed before its last events (another topic)."""
    node = NodeRow("n", "i1", 3, GONE, ts(T0), stopped_at=ts(T0 + 1))
    snap = p.Snapshot(blocks=[p.SnapshotBlock(block_hash=5, parent_hash=None, num_tokens=4)])
    b = batch("n", "i1", 4, stored(None, 1, 2), p.Removed(block_hashes=[2]),
              p.Updated(block_hash=1, cache_level=p.LevelDiff(old=0, new=1)), snap, CREATED)
    out = plan([b, batch("n", "i1", 20, stored(None, 9))], {"n": node}, {})  # a gap changes nothing either
    assert out.nodes["n"].status == GONE and out.nodes["n"].last_event_id == 20
    assert (out.upserts, out.deletes, out.resets, out.resync) == ({}, set(), set(), set())
    assert (out.counts.gaps, out.counts.anomalies, out.counts.events) == (0, 0, 6)
    assert [(r[2], r[3], r[4], r[5]) for r in out.history] == [
        (4, 0, "stored", 1), (4, 1, "stored", 2), (5, 0, "removed", 2), (6, 0, "updated", 1), (7, 0, "snapshot", 5),
        (8, 0, "created", None), (20, 0, "stored", 9)]
    # Its next instance starts clean.
    out = plan([batch("n", "i2", 0, CREATED, stored(None, 1))], {"n": node}, {})
    assert out.nodes["n"].status == LIVE and out.nodes["n"].stopped_at is None
    assert set(out.upserts) == {("n", 1)} and out.resets == {"n"}


def test_a_gone_node_that_speaks_again_needs_a_snapshot():
    node = NodeRow("n", "i1", 3, "gone", ts(T0))
    out = plan([batch("n", "i1", 4, stored(None, 1))], {"n": node}, {})
    assert out.nodes["n"].status == RESYNCING and out.resync == {"n"}
    node = NodeRow("n", "i1", 3, "stale", ts(T0))
    out = plan([batch("n", "i1", 4, stored(None, 1))], {"n": node}, {})
    assert out.nodes["n"].status == LIVE and set(out.upserts) == {("n", 1)}


def snap_part(part: int, parts: int, *blocks: tuple[int, int | None]) -> p.Snapshot:
    return p.Snapshot(blocks=[p.SnapshotBlock(block_hash=h, parent_hash=par, num_tokens=4, priority=50)
                              for h, par in blocks], part=part, parts=parts)


def test_a_snapshot_in_parts_replaces_the_state_once_and_keeps_stored_times():
    then = datetime(2026, 1, 1, tzinfo=UTC)
    node = NodeRow("n", "i1", 9, LIVE, ts(T0))
    known = {("n", h): BlockRow("n", h, None, 0, 50, 4, None, 64, then, then) for h in (1, 3, 99)}
    b = batch("n", "i1", 10, snap_part(0, 3, (1, None), (2, None)), snap_part(1, 3, (3, 1)),
              snap_part(2, 3, (4, 3)))
    assert blocks_to_look_up([b]) == {("n", h) for h in (1, 2, 3, 4)}
    out = plan([b], {"n": node}, known)
    assert out.resets == {"n"}  # block 99 goes: the snapshot does not hold it
    assert set(out.upserts) == {("n", h) for h in (1, 2, 3, 4)}
    assert {h: out.upserts[("n", h)].stored_at for h in (1, 2, 3, 4)} == {1: then, 2: ts(T0), 3: then, 4: ts(T0)}
    assert out.upserts[("n", 4)].parent_hash == 3
    assert out.nodes["n"].last_event_id == 12 and out.nodes["n"].status == LIVE
    assert [(r[2], r[3], r[4], r[5]) for r in out.history] == [
        (10, 0, "snapshot", 1), (10, 1, "snapshot", 2), (11, 0, "snapshot", 3), (12, 0, "snapshot", 4)]


def test_the_later_parts_of_a_snapshot_in_a_later_transaction_add_to_it():
    node = NodeRow("n", "i1", 9, LIVE, ts(T0))
    first = plan([batch("n", "i1", 10, snap_part(0, 2, (1, None)))], {"n": node}, {})
    assert first.resets == {"n"} and set(first.upserts) == {("n", 1)}
    row1 = first.upserts[("n", 1)]
    second = plan([batch("n", "i1", 11, snap_part(1, 2, (2, 1)), at=T0 + 1)], {"n": first.nodes["n"]},
                  {("n", 1): row1})
    assert second.resets == set()  # no second reset: part 1 adds
    assert set(second.upserts) == {("n", 2)} and second.upserts[("n", 2)].stored_at == ts(T0 + 1)
    assert second.nodes["n"].last_event_id == 11 and second.resync == set()


def test_a_later_part_whose_first_part_was_missed_is_only_recorded():
    node = NodeRow("n", "i1", 9, LIVE, ts(T0))
    out = plan([batch("n", "i1", 11, snap_part(1, 2, (2, 1)))], {"n": node}, {})  # part 0 (event 10) missed
    assert out.nodes["n"].status == RESYNCING and out.resync == {"n"} and out.counts.gaps == 1
    assert out.upserts == {} and out.resets == set()
    assert [(r[2], r[4], r[5]) for r in out.history] == [(11, "snapshot", 2)]


def test_snapshot_parts_are_numbered_within_their_count():
    with pytest.raises(ValueError, match="parts are numbered"):
        p.Snapshot(blocks=[], part=2, parts=2)
