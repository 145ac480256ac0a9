"""The Materializer without faust, Kafka or PostgreSQL: a fake writer and a fake outbox.

What goes to the DLQ and with which headers, key checks, culprit isolation, the metrics of a
commit, snapshot requests, retries, and what ``/healthz`` answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import pytest

from eventbus import protocol as p
from state_store import native
from state_store.apply import plan
from state_store.config import MaterializerSettings
from state_store.materializer import DLQ_TRUNCATE_BYTES, Materializer, Rejected
from state_store.plans import BlockRow, NodeRow, Plan
from state_store.writer import Applied, StaleCache

pytestmark = pytest.mark.unit

TOPIC = "kv-events-test"


@dataclass
class Message:
    key: bytes | None
    value: bytes | None
    topic: str = TOPIC
    partition: int = 3
    offset: int = 0


@dataclass
class Event:
    message: Message


@dataclass
class Outbox:
    dlq: list[tuple[bytes | None, bytes, dict[str, bytes]]] = field(default_factory=list)
    control: list[tuple[bytes, bytes]] = field(default_factory=list)
    max_bytes: int | None = None  # a DLQ that refuses larger messages

    async def send_dlq(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        if self.max_bytes is not None and len(value) > self.max_bytes:
            raise ValueError(f"message of {len(value)} bytes is too large")
        self.dlq.append((key, value, dict(headers)))

    async def send_control(self, key: bytes, value: bytes) -> None:
        self.control.append((key, value))


class Writer:
    """Plans like the real writer (the reference planner, from an empty database), writes nothing.

    ``poison``: nodes whose batches fail to apply (not transiently); ``transient``: errors the
    next calls raise first; ``stale``: how many planned writes find the database elsewhere."""

    def __init__(self, *, poison: Sequence[str] = (), resync_now: Sequence[str] = ()) -> None:
        self.poison = set(poison)
        self.resync_now = list(resync_now)
        self.transient: list[BaseException] = []
        self.stale = 0
        self.ping_error: BaseException | None = None
        self.applied: list[list[str]] = []  # node ids of each slow-path transaction
        self.planned: list[Plan] = []
        self.stats: list[p.NodeStats] = []
        self.pings = self.resets = 0
        self.gone: list[str] = []  # what the next liveness check marks gone
        self.pruned: list[str] = []  # ... and prunes
        self.due: list[tuple[str, int]] = []  # what the next repeat_resyncs claims
        self.prune_calls: list[float] = []

    def _fail_transiently(self) -> None:
        if self.transient:
            raise self.transient.pop(0)

    async def apply(self, batches: Sequence[p.EventBatch]) -> Applied:
        self._fail_transiently()
        if any(b.node_id in self.poison for b in batches):
            raise ValueError("value out of range for type integer")
        self.applied.append([b.node_id for b in batches])
        return Applied(plan(batches, {}, {}), self.resync_now)

    async def apply_planned(self, pl: Plan, expected: dict[str, tuple[str, int, bool] | None]) -> Applied:
        self._fail_transiently()
        if self.stale:
            self.stale -= 1
            raise StaleCache("database at ('other', 7), cache at None")
        self.planned.append(pl)
        return Applied(pl, self.resync_now)

    async def load(self, node_ids: Sequence[str]) -> tuple[list[NodeRow], list[BlockRow]]:
        return [], []

    async def apply_stats(self, stats: Sequence[p.NodeStats]) -> list[str]:
        self._fail_transiently()
        self.stats += stats
        return sorted({s.node_id for s in stats if s.status == "stopping"})

    async def mark_liveness(self, stale_after_s: float, gone_after_s: float) -> list[str]:
        self._fail_transiently()
        gone, self.gone = self.gone, []
        return gone

    async def prune_gone(self, after_s: float) -> list[str]:
        self._fail_transiently()
        self.prune_calls.append(after_s)
        pruned, self.pruned = self.pruned, []
        return pruned

    async def repeat_resyncs(self, retry_s: float, retry_max_s: float) -> list[tuple[str, int]]:
        self._fail_transiently()
        due, self.due = self.due, []
        return due

    async def run_maintenance(self, retention_days: float) -> None:
        self._fail_transiently()

    async def reset_pool(self) -> None:
        self.resets += 1

    async def ping(self, timeout_s: float = 1.0) -> None:
        self.pings += 1
        if self.ping_error is not None:
            raise self.ping_error


def batch(node: str, first_id: int = 0, *datas: p.EventData, ts: float | None = None) -> p.EventBatch:
    datas = datas or (p.Created(num_blocks_per_cache_level=[8]),)
    return p.EventBatch(schema_version=1, node_id=node, instance_id=f"{node}-i", ts=ts or time.time(),
                        events=[p.Event(event_id=first_id + i, window_size=64, data=d) for i, d in enumerate(datas)])


def message(b: p.EventBatch, offset: int, key: bytes | None = None) -> Event:
    return Event(Message(key=key if key is not None else b.node_id.encode(), value=p.encode(b), offset=offset))


def stats(node: str) -> p.NodeStats:
    return p.NodeStats(schema_version=1, node_id=node, instance_id=f"{node}-i", url="http://n", model="m",
                       block_size=4, ts=time.time(), capacity=[8, 0], used=[1, 0], active_requests=0,
                       queued_requests=0, last_event_id=0, counters=p.NodeCounters())


def make(writer: Writer | None = None, outbox: Outbox | None = None, *, native_planner: bool = False
         ) -> tuple[Materializer, Writer, Outbox]:
    w, o = writer or Writer(), outbox or Outbox()
    return Materializer(MaterializerSettings(native=native_planner, batch_max=100, group_id="g"), w, o), w, o


def sample(m: Materializer, name: str, **labels: str) -> float:
    return m.metrics.registry.get_sample_value(name, labels) or 0.0


async def run_take(m: Materializer, events: list[Event]) -> list[Event]:
    """Hand a take to the materializer; returns the events acknowledged once it is written."""
    acked: list[Event] = []
    done = asyncio.Event()

    async def ack(e: object) -> None:
        acked.append(e)  # type: ignore[arg-type]
        if len(acked) == len(events):
            done.set()

    m.start(ack)
    try:
        await m.handle_events(events)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await m.pipeline.stop()
    return acked


async def test_bad_messages_go_to_the_dlq_with_their_reason_and_source_and_the_rest_is_applied():
    m, w, o = make()
    good = [message(batch("n1"), 0), message(batch("n2"), 2)]
    bad = [Event(Message(key=b"n1", value=b"{not json", offset=1)),
           Event(Message(key=b"n1", value=None, offset=3))]
    events = [good[0], bad[0], good[1], bad[1]]
    assert await run_take(m, events) == events  # every message acknowledged, the bad ones too
    assert [pl.counts.batches for pl in w.planned] == [2]
    assert sorted(w.planned[0].nodes) == ["n1", "n2"]
    assert [(key, value) for key, value, _ in o.dlq] == [(b"n1", b"{not json"), (b"n1", b"")]
    headers = o.dlq[0][2]
    assert headers["kvflow-error-reason"] == b"malformed_json"
    assert headers["kvflow-error"]  # a human message
    assert (headers["kvflow-source-topic"], headers["kvflow-source-partition"],
            headers["kvflow-source-offset"]) == (TOPIC.encode(), b"3", b"1")
    assert o.dlq[1][2]["kvflow-source-offset"] == b"3"
    assert sample(m, "kvflow_materializer_dlq_total", reason="malformed_json") == 2
    assert sample(m, "kvflow_materializer_batches_total") == 2


async def test_a_message_whose_key_is_not_its_node_id_goes_to_the_dlq_and_is_not_applied():
    m, w, o = make()
    b = batch("node-m")
    assert Materializer.decode(message(b, 0).message) == b
    events = [message(b, 0, key=b"node-x"), message(batch("n2"), 1)]
    await run_take(m, events)
    assert len(o.dlq) == 1
    key, value, headers = o.dlq[0]
    assert (key, value) == (b"node-x", p.encode(b))
    assert headers["kvflow-error-reason"] == b"key_mismatch"
    assert b"node-m" in headers["kvflow-error"]
    assert sorted(w.planned[0].nodes) == ["n2"]
    assert sample(m, "kvflow_materializer_dlq_total", reason="key_mismatch") == 1


async def test_a_message_too_large_for_the_dlq_goes_truncated_and_one_it_cannot_take_is_counted():
    m, _, o = make(outbox=Outbox(max_bytes=DLQ_TRUNCATE_BYTES))
    big = b"x" * (DLQ_TRUNCATE_BYTES + 10)
    await m.to_dlq([Rejected(Message(key=b"k", value=big), "malformed_json", "bad")])
    assert len(o.dlq) == 1
    _, value, headers = o.dlq[0]
    assert value == big[:DLQ_TRUNCATE_BYTES]
    assert headers["kvflow-truncated-from-bytes"] == str(len(big)).encode()

    m, _, o = make(outbox=Outbox(max_bytes=10))
    await m.to_dlq([Rejected(Message(key=b"k", value=big), "malformed_json", "bad")])  # never raises
    assert o.dlq == []
    assert sample(m, "kvflow_materializer_dlq_total", reason="dlq_send_failed") == 1
    assert sample(m, "kvflow_materializer_dlq_total", reason="malformed_json") == 1


async def test_the_slow_path_isolates_the_culprit_batch_to_the_dlq_and_applies_the_others():
    m, w, o = make(Writer(poison=["bad"]))
    items = [(message(batch(n), i).message, batch(n)) for i, n in enumerate(["a", "bad", "c"])]
    await m.slow_path(items)
    assert w.applied == [["a"], ["c"]]  # the take failed whole, then batch by batch
    assert len(o.dlq) == 1
    _, _, headers = o.dlq[0]
    assert headers["kvflow-error-reason"] == b"apply_failed"
    assert headers["kvflow-error"] == b"ValueError: value out of range for type integer"
    assert headers["kvflow-source-offset"] == b"1"
    assert sample(m, "kvflow_materializer_dlq_total", reason="apply_failed") == 1
    assert sample(m, "kvflow_materializer_takes_total", planner="python") == 2


async def test_a_stale_cache_sends_the_take_the_slow_path():
    w = Writer()
    w.stale = 1
    m, _, _ = make(w)
    events = [message(batch("n1"), 0), message(batch("n2"), 1)]
    assert await run_take(m, events) == events
    assert w.planned == []
    assert w.applied == [["n1", "n2"]]
    assert m.pipeline.stale_caches == 1


@pytest.mark.skipif(not native.available(), reason="kvflow_native is not installed")
async def test_plain_batches_after_a_start_are_planned_in_parts_with_the_hot_path():
    m, w, _ = make(native_planner=True)
    start = batch("n", 0)
    plain = batch("n", 1, p.Stored(parent_hash=None, blocks=[p.StoredBlock(block_hash=1, num_tokens=4)]))
    await run_take(m, [message(start, 0), message(plain, 1)])
    assert [pl.planned_by() for pl in w.planned] == ["parts"]
    assert sample(m, "kvflow_materializer_takes_total", planner="parts") == 1
    assert sample(m, "kvflow_materializer_block_events_total") == 2


async def test_the_metrics_of_a_commit_and_the_snapshots_it_asks_for():
    m, _, o = make()
    t = time.time() - 2.0
    # n: a redelivery (dropped), a stale replay of an older instance, a gap, an anomaly.
    older = p.EventBatch(schema_version=1, node_id="n", instance_id="old", ts=t - 100, events=[
        p.Event(event_id=0, window_size=64, data=p.Created(num_blocks_per_cache_level=[8]))])
    take = [batch("n", 0, ts=t), batch("n", 0, ts=t), older,
            batch("n", 5, p.Removed(block_hashes=[1, 2]), ts=t),
            batch("m", 0, p.Created(num_blocks_per_cache_level=[8]), p.Removed(block_hashes=[9]), ts=t)]
    pl = plan(take, {}, {})
    assert pl.counts.duplicates == 1 and pl.counts.stale_replays == 1
    await m.committed(Applied(pl, ["n", "m"]), 0.25)
    assert sample(m, "kvflow_materializer_batches_total") == 3  # 5, less a duplicate and a stale replay
    assert sample(m, "kvflow_materializer_events_total") == 4
    assert sample(m, "kvflow_materializer_block_events_total") == 1 + 2 + 1 + 1
    assert sample(m, "kvflow_materializer_duplicate_batches_total") == 1
    assert sample(m, "kvflow_materializer_stale_replays_total") == 1
    assert sample(m, "kvflow_materializer_gaps_total") == 1
    assert sample(m, "kvflow_materializer_anomalies_total") == 1
    assert sample(m, "kvflow_materializer_takes_total", planner="python") == 1
    assert sample(m, "kvflow_materializer_transaction_seconds_sum") == 0.25
    assert sample(m, "kvflow_materializer_freshness_seconds_count") == 3
    assert sample(m, "kvflow_materializer_freshness_seconds_bucket", le="1.0") == 0  # all ~2 s old
    assert sample(m, "kvflow_materializer_last_commit_timestamp_seconds") == pytest.approx(time.time(), abs=5)
    # The nodes the writer says to ask now are asked, on the control topic, keyed by node.
    assert [key for key, _ in o.control] == [b"n", b"m"]
    cmd = p.decode_control(o.control[0][1])
    assert (cmd.node_id, cmd.command) == ("n", "resync")
    assert sample(m, "kvflow_materializer_resync_requests_total") == 2
    assert m.db_ok and m.last_commit > 0


async def test_heartbeats_are_written_through_a_database_outage_and_bad_ones_go_to_the_dlq():
    m, w, o = make()
    w.transient = [OSError("connection refused"), ConnectionResetError("reset")]
    events = [Event(Message(key=b"a", value=p.encode(stats("a")))), Event(Message(key=b"b", value=b"[]"))]
    await m.handle_stats(events)
    assert [s.node_id for s in w.stats] == ["a"]
    assert sample(m, "kvflow_materializer_node_stats_total") == 1
    assert sample(m, "kvflow_materializer_db_retries_total") == 2
    assert w.resets == 2  # a fresh pool after each failure
    assert [h["kvflow-error-reason"] for _, _, h in o.dlq] == [b"invalid"]


async def test_health_needs_partitions_or_a_place_in_the_group_and_a_database_that_answers():
    m, w, _ = make()
    health = await m.health(partitions_assigned=0)  # joining its group
    assert health.status_code == 503
    assert health.body["partitions_assigned"] == 0 and health.body["db_ok"] is True
    assert "not in its consumer group yet" in health.body["reason"]
    assert w.pings == 1  # nothing had reached the database yet: asked

    # In the group with no partition (more workers than partitions): a standby, healthy.
    health = await m.health(partitions_assigned=0, group_member=True)
    assert health.status_code == 200
    assert health.body["status"] == "standby" and health.body["reason"] is None

    health = await m.health(partitions_assigned=6, group_member=True)
    assert health.status_code == 200
    assert health.body == {"status": "ok", "db_ok": True, "last_commit": 0.0, "group_id": "g",
                           "partitions_assigned": 6, "group_member": True, "reason": None}
    assert w.pings == 1  # the last answer is recent: not asked again

    # The database goes away: the next liveness check fails, and /healthz asks it (in vain).
    w.transient, w.ping_error = [OSError("connection refused")], OSError("connection refused")
    await m.liveness()
    assert not m.db_ok
    health = await m.health(partitions_assigned=6)
    assert health.status_code == 503
    assert health.body["status"] == "unavailable" and health.body["db_ok"] is False
    assert health.body["reason"] == "database unreachable (OSError: connection refused)"
    assert w.pings == 2

    w.ping_error = None  # it is back
    health = await m.health(partitions_assigned=6)
    assert health.status_code == 200 and health.body["db_ok"] is True
    assert m.db_ok


async def test_a_commit_makes_the_database_count_as_reachable_without_asking():
    m, w, _ = make()
    w.ping_error = TimeoutError()
    await m.committed(Applied(plan([batch("n")], {}, {}), []), 0.01)
    assert (await m.health(partitions_assigned=1)).status_code == 200
    assert w.pings == 0


@dataclass
class FlakyOutbox(Outbox):
    """A control topic whose first send fails."""

    failures: int = 1

    async def send_control(self, key: bytes, value: bytes) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("producer buffer full")
        await super().send_control(key, value)


async def test_nodes_still_resyncing_are_asked_again_and_a_failed_send_stops_nothing():
    m, w, o = make(outbox=FlakyOutbox())
    w.due = [("n", 2), ("m", 3)]  # what the database says is due (its backoff: test_writer_nodes)
    await m.repeat_resyncs()
    assert [key for key, _ in o.control] == [b"m"]  # n's send failed: logged, asked again later
    cmd = p.decode_control(o.control[0][1])
    assert (cmd.node_id, cmd.command, cmd.reason) == ("m", "resync", "still resyncing: request 3")
    assert sample(m, "kvflow_materializer_resync_repeats_total") == 2
    await m.repeat_resyncs()  # nothing due
    assert len(o.control) == 1
    w.transient = [OSError("connection refused")]
    await m.repeat_resyncs()  # skipped without the database
    assert not m.db_ok
    # A commit's requests do not fail the take either.
    o.failures = 1
    await m.committed(Applied(plan([batch("x")], {}, {}), ["x", "y"]), 0.01)
    assert [key for key, _ in o.control] == [b"m", b"y"]


async def test_a_goodbye_is_decoded_and_drops_the_workers_cache():
    m, w, o = make()
    gen = m.pipeline.planner.generation
    bye = msgspec.structs.replace(stats("a"), status="stopping")
    await m.handle_stats([Event(Message(key=b"a", value=p.encode(bye))), Event(Message(key=b"b", value=p.encode(
        stats("b"))))])
    assert o.dlq == []
    assert [(s.node_id, s.status) for s in w.stats] == [("a", "stopping"), ("b", "live")]
    assert m.pipeline.planner.generation == gen + 1  # its next batches are planned from the database
    assert sample(m, "kvflow_materializer_goodbyes_total") == 1
    await m.handle_stats([Event(Message(key=b"b", value=p.encode(stats("b"))))])
    assert m.pipeline.planner.generation == gen + 1


async def test_a_connection_broken_mid_operation_skips_the_liveness_check_instead_of_crashing():
    import asyncpg

    m, w, _ = make()
    # what asyncpg's pool raised releasing a connection PostgreSQL had dropped mid-query
    w.transient = [asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress")]
    await m.liveness()  # skipped, not raised (a faust timer's exception crashes the worker)
    assert not m.db_ok
    await m.liveness()
    assert m.db_ok


async def test_liveness_prunes_long_gone_nodes_and_drops_the_cache_when_nodes_go_or_are_pruned():
    m, w, _ = make()
    gen = m.pipeline.planner.generation
    await m.liveness()
    assert w.prune_calls == [3600.0] and m.pipeline.planner.generation == gen
    w.gone = ["a"]
    await m.liveness()
    assert m.pipeline.planner.generation == gen + 1
    w.pruned = ["b", "c"]
    await m.liveness()
    assert m.pipeline.planner.generation == gen + 2
    assert sample(m, "kvflow_materializer_nodes_pruned_total") == 2
    never = Materializer(MaterializerSettings(prune_gone_after_s=0, group_id="g"), w, Outbox())
    await never.liveness()
    assert w.prune_calls == [3600.0] * 3  # 0: never pruned
