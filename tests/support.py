"""Helpers shared by integration tests: processes we start, in-process KV nodes, SQL snapshots."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import asyncpg

from eventbus.config import KafkaSettings
from eventbus.protocol import InstanceId, NodeCounters, NodeId, NodeStats, from_sql
from eventbus.publisher import InMemorySink, KafkaSink, Publisher
from eventbus.replay import BlockState
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager, OutOfBlocks
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange
from kvflow.stack import Paths, Postgres, StackSettings, free_port, project_dir
from state_store.config import plain_dsn

ROOT = Path(__file__).resolve().parents[1]


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@contextlib.contextmanager
def own_topics(bootstrap: str) -> Iterator[KafkaSettings]:
    """Kafka settings with topics of their own: created, and deleted after the block."""
    from eventbus.kafka import delete_topics, ensure_topics, topic_specs

    suffix = uuid.uuid4().hex[:10]
    s = KafkaSettings(bootstrap=bootstrap, events_topic=f"kv-events-{suffix}", stats_topic=f"node-stats-{suffix}",
                      dlq_topic=f"kv-events-dlq-{suffix}", control_topic=f"kv-control-{suffix}")
    ensure_topics(s)
    try:
        yield s
    finally:
        delete_topics(s, [t.name for t in topic_specs(s)])


def kafka_env(k: KafkaSettings) -> dict[str, str]:
    return {"KVFLOW_KAFKA_BOOTSTRAP": k.bootstrap, "KVFLOW_KAFKA_EVENTS_TOPIC": k.events_topic,
            "KVFLOW_KAFKA_STATS_TOPIC": k.stats_topic, "KVFLOW_KAFKA_DLQ_TOPIC": k.dlq_topic,
            "KVFLOW_KAFKA_CONTROL_TOPIC": k.control_topic}


@contextlib.contextmanager
def private_postgres(tmp_path: Path) -> Iterator[Postgres]:
    """A PostgreSQL cluster of the test's own (own folder, own port), for tests that stop and
    start it; stopped and removed afterwards."""
    home = tmp_path / "pg-home"
    pg = Postgres(Paths(project=project_dir(), home=home),
                  StackSettings(home=home, postgres_port=free_port(), start_timeout_s=90))
    pg.external_url = None
    try:
        pg.up(lambda _m: None)
        yield pg
    finally:
        pg.down()
        if not pg.base.is_relative_to(tmp_path):
            shutil.rmtree(pg.base, ignore_errors=True)


class ServiceProcess:
    """A kvflow service started by a test (by pid only; stopped by the test)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServiceProcess:
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", *self.args], env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def materializer(kafka: KafkaSettings, database_url: str, tmp: Path, group: str | None = None,
                 **extra_env: str) -> ServiceProcess:
    env = {**kafka_env(kafka), "KVFLOW_DATABASE_URL": database_url,
           "KVFLOW_MATERIALIZER_GROUP_ID": group or f"mat-{uuid.uuid4().hex[:8]}",
           "KVFLOW_MATERIALIZER_WEB_PORT": str(free_port()), "KVFLOW_MATERIALIZER_DATADIR": str(tmp / "faust"),
           "KVFLOW_MATERIALIZER_SESSION_TIMEOUT_S": "6", **extra_env}
    return ServiceProcess(["materializer", "--loglevel", "warn"], env, tmp / "materializer.log")


# ------------------------------------------------------------------------------ in-process nodes


class CoreNode:
    """A KV core with a Kafka publisher, driven by a seeded random workload (no torch)."""

    SEGMENTS: ClassVar[list[list[int]]] = [list(range(s, s + 4)) for s in range(0, 400, 10)]

    def __init__(self, kafka: KafkaSettings | None, node_id: str, *, gpu: int = 24, host: int = 16, seed: int = 0,
                 instance_id: str | None = None, max_queued_events: int = 100_000,
                 snapshot_part_blocks: int = 16_384) -> None:
        """``kafka=None``: batches stay in an InMemorySink (``self.sink.batches``)."""
        self.node_id = node_id
        self.instance_id = instance_id or uuid.uuid4().hex
        self.clock = ManualClock()
        self.core = KVCacheManager(KvCacheConfig(num_gpu_blocks=gpu, num_host_blocks=host, block_size=4,
                                                 window_size=64, max_queued_events=max_queued_events,
                                                 snapshot_part_blocks=snapshot_part_blocks),
                                   clock=self.clock)
        self.sink: Any = KafkaSink(kafka, node_id) if kafka is not None else InMemorySink()
        self.publisher = Publisher(self.core, self.sink, node_id, self.instance_id, max_events_per_batch=7)
        self.rng = random.Random(seed)
        self.active: list[str] = []
        self.n = 0

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.45 or not self.active:
            segs = [rng.randrange(len(self.SEGMENTS)) for _ in range(rng.randint(1, 5))]
            if rng.random() < 0.5:
                segs = [0, 1, *segs]  # a shared "system prompt"
            tokens = [t for s in segs for t in self.SEGMENTS[s]] + [999] * rng.randint(0, 3)
            ret = None
            if rng.random() < 0.5:
                ret = KvCacheRetentionConfig(
                    (TokenRange(0, 8, rng.choice([10, 50, 100]), rng.choice([None, 1.0])),
                     TokenRange(8, None, rng.choice([0, 35, 70]))), decode_priority=rng.choice([20, 60]))
            rid = f"{self.node_id}-r{self.n}"
            self.n += 1
            try:
                self.core.allocate(rid, Prompt.from_tokens(tokens, 4), ret)
                self.active.append(rid)
            except OutOfBlocks:
                pass
        elif r < 0.65:
            rid = rng.choice(self.active)
            with contextlib.suppress(OutOfBlocks):
                self.core.append_token(rid, rng.randrange(5))
        elif r < 0.95:
            rid = self.active.pop(rng.randrange(len(self.active)))
            self.core.free(rid)
        else:
            self.clock.advance(0.7)
            self.core.tick()
        self.publisher.pump()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def finish(self) -> None:
        """Free every request and deliver everything."""
        for rid in self.active:
            self.core.free(rid)
        self.active.clear()
        assert self.publisher.drain(30) == 0

    def truth(self) -> dict[int, BlockState]:
        from eventbus.replay import NodeState

        return NodeState.from_snapshot_blocks(self.core.cached_blocks())


def heartbeat(node: CoreNode, status: str = "live") -> NodeStats:
    """The NodeStats an in-process node's engine would send now (``status``: live, or stopping
    for its goodbye)."""
    stats = node.core.stats
    return NodeStats(schema_version=1, node_id=NodeId(node.node_id), instance_id=InstanceId(node.instance_id),
                     url=f"http://{node.node_id}.invalid", model="m", block_size=4, ts=time.time(),
                     capacity=[node.core.config.num_gpu_blocks, node.core.config.num_host_blocks], used=[0, 0],
                     active_requests=len(node.active), queued_requests=0, last_event_id=node.core.last_event_id,
                     counters=NodeCounters(prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens),
                     status=status)  # type: ignore[arg-type]


def send_heartbeat(node: CoreNode, status: str = "live") -> None:
    """Send :func:`heartbeat` on the node's Kafka sink, delivered."""
    node.sink.send_stats(heartbeat(node, status))
    assert node.sink.flush(30) == 0


async def _fetch(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


def fetch(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    return asyncio.run(_fetch(url, sql, *args))


def sql_blocks(url: str, node_id: str) -> dict[int, BlockState]:
    rows = fetch(url, """SELECT block_hash, parent_hash, num_tokens, lora_id, cache_level, priority
                         FROM node_blocks WHERE node_id = $1""", node_id)
    return {from_sql(r["block_hash"]): BlockState(
        from_sql(r["parent_hash"]) if r["parent_hash"] is not None else None, r["num_tokens"], r["lora_id"],
        r["cache_level"], r["priority"]) for r in rows}


def node_row(url: str, node_id: str) -> asyncpg.Record | None:
    rows = fetch(url, "SELECT * FROM nodes WHERE node_id = $1", node_id)
    return rows[0] if rows else None


def applied_through(url: str, node: CoreNode) -> bool:
    row = node_row(url, node.node_id)
    return (row is not None and row["instance_id"] == node.instance_id
            and row["last_event_id"] == node.core.last_event_id and row["status"] == "live")


def heartbeats_idle(url: str, *node_ids: str) -> bool:
    """Every one of the nodes' latest heartbeat in PostgreSQL says it runs and queues nothing (a
    decision then weighs no load left over from a request that has finished)."""
    rows = fetch(url, "SELECT active_blocks, active_requests, queued_requests FROM nodes WHERE node_id = ANY($1)",
                 list(node_ids))
    return len(rows) == len(node_ids) and not any(
        r["active_blocks"] or r["active_requests"] or r["queued_requests"] for r in rows)


def applied_through_id(url: str, node_id: str, min_blocks: int = 0) -> bool:
    """The node is live in PostgreSQL, has applied what its heartbeat says it emitted, and holds
    at least ``min_blocks`` blocks."""
    row = node_row(url, node_id)
    if row is None or row["status"] != "live" or row["reported_event_id"] is None:
        return False
    blocks = fetch(url, "SELECT count(*) AS c FROM node_blocks WHERE node_id = $1", node_id)[0]["c"]
    return row["last_event_id"] >= row["reported_event_id"] and blocks >= min_blocks


def history_duplicates(url: str, node_id: str) -> int:
    return fetch(url, """SELECT count(*) - count(DISTINCT (instance_id, event_id, seq)) AS d
                         FROM block_events WHERE node_id = $1""", node_id)[0]["d"]


# ------------------------------------------------------------------------------ network faults


class TcpProxy:
    """A TCP forwarder a test can cut (every connection dropped, new ones refused) and restore."""

    def __init__(self, target_port: int, listen_port: int | None = None) -> None:
        import threading

        self.target_port = target_port
        self.port = listen_port or free_port()
        self._open = True
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", self.port))
        self._server.listen(64)
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self._open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or not self._open:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def cut(self) -> None:
        self._open = False
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self._open = True

    def close(self) -> None:
        self._stop = True
        self.cut()
        self._server.close()


def http_ok(url: str) -> bool:
    """GET url answers 200 (False while it does not answer at all)."""
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
