"""A materializer worker group: workers with one group id share kv-events' partitions, and
exactly once in effect holds across rebalances.

The fence is the node's ``last_event_id`` (and instance), checked under the node rows' lock in the
transaction that writes the take: a worker that lost a partition (a zombie: paused past its
session, or still writing when the group moved on) can commit nothing for it that the new owner
has already applied. A revocation also drops the worker's cache (the assignment's generation),
so the plans made from it are never written as planned.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from eventbus import protocol as p
from state_store.config import MaterializerSettings
from state_store.materializer import Materializer
from state_store.writer import Writer
from tests.reliability.exactness import Publishing, assert_exact
from tests.state_store.test_materializer import Recorder, expected_history_rows
from tests.state_store.test_materializer_unit import Outbox, message, run_take, sample
from tests.support import CoreNode, _fetch, applied_through, free_port, materializer, wait_for

pytestmark = pytest.mark.integration


def worker(url: str) -> Materializer:
    return Materializer(MaterializerSettings(group_id="g", batch_max=500), Writer(url), Outbox())


def recorded_batches(seed: int, steps: int) -> tuple[CoreNode, list[p.EventBatch]]:
    node = CoreNode(None, "node-z", seed=seed)
    node.run(steps)
    node.finish()
    return node, list(node.sink.batches)


async def db_state(url: str) -> tuple[list, int]:
    blocks = await _fetch(url, "SELECT block_hash, cache_level, priority FROM node_blocks "
                               "WHERE node_id = 'node-z' ORDER BY 1")
    return [tuple(r) for r in blocks], (await _fetch(url, "SELECT count(*) AS c FROM block_events"))[0]["c"]


@pytest.mark.parametrize("revoked", [False, True], ids=["zombie", "revoked"])
async def test_a_take_of_a_lost_partition_commits_nothing_the_new_owner_applied(migrated_database_url, revoked):
    """Worker A applies the first half of a node's batches; the partition moves to B, which gets
    them all again (from the committed offset) and applies the rest; then A writes the second half
    it had fetched before it lost the partition. It changes nothing."""
    url = migrated_database_url
    node, batches = recorded_batches(seed=5, steps=300)
    half = len(batches) // 2
    msgs = [message(b, i) for i, b in enumerate(batches)]
    a, b = worker(url), worker(url)
    try:
        await run_take(a, msgs[:half])
        await run_take(b, msgs)  # the new owner: everything from offset 0
        before = await db_state(url)
        if revoked:
            a.partitions_revoked(6)  # what faust tells A once the rebalance took its partitions
        await run_take(a, msgs[half:])  # the zombie's take, planned from its cache of before
        assert await db_state(url) == before
        assert sample(a, "kvflow_materializer_duplicate_batches_total") == len(batches) - half
        assert sample(a, "kvflow_materializer_events_total") == sum(len(x.events) for x in batches[:half])
        a.metrics_text()
        # Zombie: its cache said the node was at half; under the lock it was not: replanned (stale).
        # Revoked: the cache was dropped, the take planned from the database at once.
        assert sample(a, "kvflow_materializer_stale_caches_total") == (0 if revoked else 1)
        assert sample(a, "kvflow_materializer_partitions_revoked_total") == (1 if revoked else 0)
        rows = (await _fetch(url, "SELECT * FROM nodes WHERE node_id = 'node-z'"))[0]
        assert rows["last_event_id"] == node.core.last_event_id and rows["status"] == "live"
        dup = await _fetch(url, "SELECT count(*) - count(DISTINCT (instance_id, event_id, seq)) AS d FROM block_events")
        assert dup[0]["d"] == 0
        events = [e for x in batches for e in x.events]
        assert before[1] == expected_history_rows(events)
    finally:
        await asyncio.gather(a.writer.close(), b.writer.close())  # type: ignore[attr-defined]


def assigned(port: int) -> int:
    try:
        return int(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["partitions_assigned"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_two_workers_share_the_partitions_and_one_killed_mid_stream_loses_and_doubles_nothing(
        kafka_settings, migrated_database_url, tmp_path: Path):
    db, k = migrated_database_url, kafka_settings
    nodes = [CoreNode(k, f"node-g{i}", seed=10 + i) for i in range(4)]
    recs = [Recorder(n) for n in nodes]
    group = f"mat-group-{free_port()}"
    total = 12  # kv-events' and node-stats' partitions (6 each)
    ports = [free_port(), free_port()]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = materializer(k, db, tmp_path / "a", group=group, KVFLOW_MATERIALIZER_WEB_PORT=str(ports[0])).start()
    b = materializer(k, db, tmp_path / "b", group=group, KVFLOW_MATERIALIZER_WEB_PORT=str(ports[1]))
    try:
        wait_for(lambda: assigned(ports[0]) == total, 60, what="worker A to take every partition")
        with Publishing(*nodes):
            b.start()  # joins mid-stream: the partitions are shared
            wait_for(lambda: 0 < assigned(ports[0]) < total and 0 < assigned(ports[1]) < total, 60,
                     what="the partitions to be shared by A and B")
            wait_for(lambda: all(n.core.last_event_id > 80 for n in nodes), 60, what="the stream under way")
            a.kill9()  # mid-stream, its last takes neither committed nor acknowledged
            wait_for(lambda: assigned(ports[1]) == total, 60, what="B to take A's partitions")
            mark = min(n.core.last_event_id for n in nodes)
            wait_for(lambda: all(n.core.last_event_id > mark + 80 for n in nodes), 60, what="more of the stream")
        for n in nodes:
            n.finish()
        wait_for(lambda: all(applied_through(db, n) for n in nodes), 120, what="B to catch up")
        assert b.alive(), b.tail()
        for n, rec in zip(nodes, recs, strict=True):
            assert_exact(db, n, rec, k)
    finally:
        a.stop()
        b.stop()


def test_a_worker_paused_past_its_session_rejoins_without_writing_over_the_new_owner(
        kafka_settings, migrated_database_url, tmp_path: Path):
    """SIGSTOP: the group drops A and gives its partitions to B, which applies A's fetched takes
    again and more; SIGCONT: A wakes with its takes planned from the cache of before, finds it
    lost the partitions, and the state stays exact."""
    import os
    import signal

    db, k = migrated_database_url, kafka_settings
    nodes = [CoreNode(k, f"node-p{i}", seed=20 + i) for i in range(3)]
    recs = [Recorder(n) for n in nodes]
    group = f"mat-pause-{free_port()}"
    ports = [free_port(), free_port()]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = materializer(k, db, tmp_path / "a", group=group, KVFLOW_MATERIALIZER_WEB_PORT=str(ports[0])).start()
    b = materializer(k, db, tmp_path / "b", group=group, KVFLOW_MATERIALIZER_WEB_PORT=str(ports[1])).start()
    try:
        wait_for(lambda: 0 < assigned(ports[0]) < 12 and 0 < assigned(ports[1]) < 12, 60, what="a shared group")
        with Publishing(*nodes):
            wait_for(lambda: all(n.core.last_event_id > 60 for n in nodes), 60, what="the stream under way")
            assert a.proc is not None
            os.kill(a.proc.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: assigned(ports[1]) == 12, 60, what="B to take the paused worker's partitions")
                mark = min(n.core.last_event_id for n in nodes)
                wait_for(lambda: all(n.core.last_event_id > mark + 60 for n in nodes), 60, what="more of the stream")
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            wait_for(lambda: 0 < assigned(ports[0]) < 12, 60, what="A to rejoin the group")
        for n in nodes:
            n.finish()
        wait_for(lambda: all(applied_through(db, n) for n in nodes), 120, what="the group to catch up")
        assert a.alive() and b.alive(), a.tail() + b.tail()
        assert metric(ports[0], "kvflow_materializer_partitions_revoked_total") >= 1  # its cache was dropped
        for n, rec in zip(nodes, recs, strict=True):
            assert_exact(db, n, rec, k)
    finally:
        a.stop()
        b.stop()


def healthz(port: int) -> tuple[int, dict]:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return 0, {}


def test_a_worker_without_partitions_is_a_healthy_standby_and_takes_over_when_the_owners_die(
        kafka_bootstrap, migrated_database_url, tmp_path: Path):
    """More workers than partitions: kv-events and node-stats of one partition each, three workers.
    The one left without a partition answers /healthz 200 ``standby`` (a member of the group, not
    joining); killed, the owners' partitions go to it, and it applies the stream."""
    import uuid

    from confluent_kafka.admin import AdminClient, NewTopic

    from eventbus.config import KafkaSettings
    from eventbus.kafka import delete_topics, ensure_topics, topic_specs

    s = uuid.uuid4().hex[:8]
    k = KafkaSettings(bootstrap=kafka_bootstrap, events_topic=f"ev-1p-{s}", stats_topic=f"st-1p-{s}",
                      dlq_topic=f"dlq-1p-{s}", control_topic=f"ctl-1p-{s}")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for f in admin.create_topics([NewTopic(t, 1, 1) for t in (k.events_topic, k.stats_topic)]).values():
        f.result(30)
    ensure_topics(k)  # the DLQ and the control topic
    db, group = migrated_database_url, f"mat-standby-{s}"
    ports = [free_port() for _ in range(3)]
    workers = []
    for i, port in enumerate(ports):
        (tmp_path / str(i)).mkdir()
        workers.append(materializer(k, db, tmp_path / str(i), group=group,
                                    KVFLOW_MATERIALIZER_WEB_PORT=str(port)).start())
    try:
        def settled() -> bool:
            answers = [healthz(p) for p in ports]
            return (all(code == 200 for code, _ in answers) and sum(b["partitions_assigned"] for _, b in answers) == 2
                    and any(b["status"] == "standby" for _, b in answers))
        wait_for(settled, 90, what="three workers in one group, one of them a standby")
        standby = next(i for i, p in enumerate(ports) if healthz(p)[1]["status"] == "standby")
        body = healthz(ports[standby])[1]
        assert body["partitions_assigned"] == 0 and body["group_member"] is True and body["reason"] is None
        node = CoreNode(k, "node-standby", seed=31)
        rec = Recorder(node)
        node.run(150)
        node.finish()
        wait_for(lambda: applied_through(db, node), 60, what="the owners to apply the stream")
        for i, w in enumerate(workers):
            if i != standby:
                w.kill9()
        wait_for(lambda: healthz(ports[standby])[1].get("partitions_assigned") == 2, 60,
                 what="the standby to take both partitions")
        assert healthz(ports[standby])[1]["status"] == "ok"
        node.run(150)
        node.finish()
        wait_for(lambda: applied_through(db, node), 60, what="the former standby to apply the stream")
        assert_exact(db, node, rec, k)
    finally:
        for w in workers:
            if w.alive():
                w.stop()
        delete_topics(k, [t.name for t in topic_specs(k)])
