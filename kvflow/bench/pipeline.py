"""``kvflow bench pipeline``: block events per second from Kafka into PostgreSQL, and freshness.

1. Throughput. KV cores (no torch) run a churning workload. A materializer worker is started on
   fresh topics and a fresh database and warmed up (one small batch round trip); then the whole
   stream is produced at once and the worker drains it as fast as it can. Figure: block events
   per second, from the first produce to the last node's last event being in ``nodes``.
2. Raw ceiling, measured in the same run: the same history rows and the same final
   ``node_blocks`` rows written straight into the same tables of another fresh database with the
   fastest statement there is (binary ``COPY``), no Kafka, no decoding, no planning.
   1 and 2 alternate for ``rounds`` rounds (3), each round's stream under node ids of its own;
   the figures are the medians, every round is in ``details``.
3. Freshness. With the worker caught up, batches are produced at a steady 10k block events/s;
   for each row, ``ingested_at - event_ts`` (the node's publish time to the row's insert by the
   materializer, on this machine's one clock), p50 and p99.
4. ``workers=2``: in each round, the same stream (node ids of its own again) also through a group of
   two workers on topics of their own, into the same database (``figures.events_per_s_2_workers``,
   ``ratios.two_workers_vs_one``). On one machine the two workers share its cores (and PostgreSQL's):
   the ratio says what a second worker costs in coordination and contention here, not the scale-up
   of workers on machines of their own (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import asyncpg
import httpx
import msgspec
from confluent_kafka import Producer

from eventbus.config import KafkaSettings
from eventbus.kafka import delete_topics, ensure_topics, make_producer, topic_specs
from eventbus.protocol import EventBatch, InstanceId, NodeId, encode
from eventbus.publisher import InMemorySink, Publisher
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from kvflow.bench.harness import BenchResult, Samples, percentile
from kvflow.bench.kv import synthetic_stream
from kvflow.bench.scratch import scratch_database
from kvflow.stack import free_port
from kvflow.supervise import kvflow_argv, spawn_child, stop_groups
from state_store.apply import plan
from state_store.config import DatabaseSettings, plain_dsn

PROJECT = Path(__file__).resolve().parents[2]


def make_batches(nodes: int, requests_per_node: int, *, pool_blocks: int = 1500, events_per_batch: int = 250,
                 seed: int = 11) -> list[EventBatch]:
    """Event batches of ``nodes`` KV cores running a synthetic workload that keeps evicting."""
    out: list[EventBatch] = []
    for n in range(nodes):
        core = KVCacheManager(KvCacheConfig(num_gpu_blocks=pool_blocks, num_host_blocks=pool_blocks // 2,
                                            block_size=32, max_queued_events=1 << 22))
        sink = InMemorySink()
        pub = Publisher(core, sink, NodeId(f"bench-node-{n}"), InstanceId(uuid.uuid4().hex),
                        max_events_per_batch=events_per_batch,
                        max_in_flight=1 << 30)
        for i, prompt in enumerate(synthetic_stream(requests_per_node, seed=seed + n)):
            core.allocate("r", prompt)
            core.free("r")
            if i % 16 == 0:
                pub.pump()
        pub.pump()
        out.extend(sink.batches)
    return out


def block_events(batches: list[EventBatch]) -> int:
    return len(plan(batches, {}, {}).history)


def _produce(k: KafkaSettings, batches: list[EventBatch]) -> None:
    _produce_encoded(k, [(b.node_id.encode(), encode(b)) for b in batches])


def _ready_producer(k: KafkaSettings) -> Producer:
    """A producer that has delivered a message already. librdkafka connects and gets its
    idempotent producer id on the first ``produce``, holding that message ~0.5 s meanwhile (not
    the pipeline's time; ``list_topics`` alone does not wait for it). The warm-up message goes to
    the run's own DLQ topic, which the worker only ever writes to."""
    producer = make_producer(k)
    producer.produce(k.dlq_topic, key=b"kvflow-bench-warmup", value=b"")
    assert producer.flush(30) == 0
    producer.list_topics(k.events_topic, timeout=30)
    return producer


def _produce_encoded(k: KafkaSettings, messages: list[tuple[bytes, bytes]], producer: Producer | None = None) -> None:
    producer = producer or _ready_producer(k)
    for key, value in messages:
        while True:
            try:
                producer.produce(k.events_topic, key=key, value=value)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(60) == 0


def raw_ceiling(url: str, batches: list[EventBatch]) -> tuple[float, int]:
    """Seconds to COPY the same history and final node_blocks rows into fresh tables."""
    p = plan(batches, {}, {})
    from state_store.plans import HISTORY_COLUMNS

    blocks = [(r.node_id, r.block_hash, r.parent_hash, r.cache_level, r.priority, r.num_tokens, r.lora_id,
               r.window_size, r.stored_at, r.updated_at) for r in p.upserts.values()]

    async def run() -> float:
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            t0 = time.perf_counter()
            async with conn.transaction():
                await conn.copy_records_to_table("block_events", records=p.history, columns=HISTORY_COLUMNS)
                await conn.copy_records_to_table("node_blocks", records=blocks, columns=[
                    "node_id", "block_hash", "parent_hash", "cache_level", "priority", "num_tokens", "lora_id",
                    "window_size", "stored_at", "updated_at"])
            return time.perf_counter() - t0
        finally:
            await conn.close()

    return asyncio.run(run()), len(p.history)


def _materializer(k: KafkaSettings, url: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    e = {**os.environ, "KVFLOW_KAFKA_BOOTSTRAP": k.bootstrap, "KVFLOW_KAFKA_EVENTS_TOPIC": k.events_topic,
         "KVFLOW_KAFKA_STATS_TOPIC": k.stats_topic, "KVFLOW_KAFKA_DLQ_TOPIC": k.dlq_topic,
         "KVFLOW_KAFKA_CONTROL_TOPIC": k.control_topic, "KVFLOW_DATABASE_URL": url,
         "KVFLOW_MATERIALIZER_GROUP_ID": f"bench-{uuid.uuid4().hex[:8]}", "KVFLOW_MATERIALIZER_WEB_PORT": "0",
         **env}
    return spawn_child(kvflow_argv("materializer", "--loglevel", "warn"), log, e, PROJECT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_groups([proc], 30)


class WorkerGroup:
    """``n`` materializer workers in one consumer group, on topics of their own, into ``url``."""

    def __init__(self, base: KafkaSettings, url: str, n: int, log: Path) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.k = base.model_copy(update={"events_topic": f"bench-events-{suffix}",
                                         "stats_topic": f"bench-stats-{suffix}", "dlq_topic": f"bench-dlq-{suffix}",
                                         "control_topic": f"bench-control-{suffix}"})
        self.url, self.n, self.log = url, n, log
        self.group = f"bench-group-{suffix}"
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def assigned(self) -> list[int]:
        """The partitions each worker has now (-1: it does not answer yet)."""
        out = []
        for port in self.ports:
            try:
                out.append(int(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()["partitions_assigned"]))
            except (httpx.HTTPError, ValueError, KeyError):
                out.append(-1)
        return out

    @contextlib.contextmanager
    def running(self) -> Iterator[WorkerGroup]:
        """Start the workers, wait until they share every partition, warm them up; stop them after."""
        ensure_topics(self.k)
        total = sum(t.partitions for t in topic_specs(self.k) if t.name in (self.k.events_topic, self.k.stats_topic))
        try:
            self.procs = [_materializer(self.k, self.url, self.log, KVFLOW_MATERIALIZER_GROUP_ID=self.group,
                                        KVFLOW_MATERIALIZER_WEB_PORT=str(port)) for port in self.ports]
            deadline = time.monotonic() + 120
            while not ((a := self.assigned()) and min(a) > 0 and sum(a) == total):
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"the {self.n} workers did not share the partitions ({a}); see {self.log}")
                time.sleep(0.2)
            warm = make_batches(4, 10, seed=6)
            for b in warm:
                b.node_id = NodeId(f"warmup-{self.group}-{b.node_id}")
            _produce(self.k, warm)
            _wait(self.url, {b.node_id: b.events[-1].event_id for b in warm}, self.procs, self.log, 120)
            yield self
        finally:
            stop_groups(self.procs, 30)
            delete_topics(self.k, [t.name for t in topic_specs(self.k)])

    def drain(self, stream: list[EventBatch]) -> float:
        """Seconds from the first produce of ``stream`` to its last events in ``nodes``."""
        targets = {b.node_id: b.events[-1].event_id for b in stream}
        encoded = [(b.node_id.encode(), encode(b)) for b in stream]
        producer = _ready_producer(self.k)
        t0 = time.monotonic()
        _produce_encoded(self.k, encoded, producer)
        return _wait(self.url, targets, self.procs, self.log, 600) - t0


def bench_pipeline(*, nodes: int = 8, requests_per_node: int = 2500, freshness_rate: float = 10_000,
                   freshness_s: float = 20.0, rounds: int = 3, log_dir: Path | None = None, workers: int = 1,
                   say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """The figures of the module's docstring; ``workers=2`` adds a group of two workers."""
    res = BenchResult("pipeline")
    base = KafkaSettings()
    suffix = uuid.uuid4().hex[:8]
    k = base.model_copy(update={"events_topic": f"bench-events-{suffix}", "stats_topic": f"bench-stats-{suffix}",
                                "dlq_topic": f"bench-dlq-{suffix}", "control_topic": f"bench-control-{suffix}"})
    admin_url = DatabaseSettings().writer()
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    log = log_dir / f"kvflow-bench-pipeline-{suffix}.log"

    say(f"generating the event stream of {nodes} KV cores …")
    batches = make_batches(nodes, requests_per_node)
    total = block_events(batches)
    res.details.update({"nodes": nodes, "batches": len(batches), "events": sum(len(b.events) for b in batches),
                        "block_events": total, "rounds": rounds, "materializer_log": str(log)})

    ensure_topics(k)
    raw_s: list[float] = []
    mat_s: list[float] = []
    try:
        with scratch_database(admin_url, "kvflow_bench_raw") as raw_url, \
                scratch_database(admin_url, "kvflow_bench") as url:
            proc = _materializer(k, url, log)
            try:
                say("starting a materializer worker and warming it up …")
                warm = make_batches(1, 20, seed=5)
                for b in warm:
                    b.node_id = NodeId("warmup")
                _produce(k, warm)
                _wait(url, {NodeId("warmup"): warm[-1].events[-1].event_id}, proc, log, 120)

                with contextlib.ExitStack() as stack:
                    group = None
                    if workers > 1:
                        say(f"starting a group of {workers} workers on topics of their own …")
                        group = stack.enter_context(WorkerGroup(base, url, workers, log).running())
                    group_s = _rounds(res, k, url, raw_url, proc, log, batches, rounds, group, raw_s, mat_s, say)
                res.figures["events_per_s"] = total / Samples(mat_s).median
                if group_s:
                    res.figures[f"events_per_s_{workers}_workers"] = total / Samples(group_s).median
                    res.details[f"throughput_seconds_{workers}_workers"] = Samples(group_s).as_dict()
                    res.ratios["two_workers_vs_one" if workers == 2 else f"workers_{workers}_vs_one"] = (
                        res.figures[f"events_per_s_{workers}_workers"] / res.figures["events_per_s"])
                    res.details["workers_note"] = (
                        f"{workers} workers and one share this machine's {os.cpu_count()} cores and one PostgreSQL: "
                        "the ratio is the cost of coordination and contention here, not the scale-up of workers "
                        "on machines of their own")
                res.baseline["raw_events_per_s"] = total / Samples(raw_s).median
                res.details["throughput_seconds"] = Samples(mat_s).as_dict()
                res.details["raw_seconds"] = Samples(raw_s).as_dict()

                say(f"freshness at {freshness_rate:,.0f} block events/s for {freshness_s:.0f} s …")
                fresh = make_batches(4, int(requests_per_node * 2), seed=99)
                lat = _freshness(k, url, fresh, freshness_rate, freshness_s)
                res.figures["freshness_p50_ms"] = percentile(lat, 50) * 1000
                res.figures["freshness_p99_ms"] = percentile(lat, 99) * 1000
                res.details["freshness_rows"] = len(lat)
            finally:
                _stop(proc)
    finally:
        delete_topics(k, [t.name for t in topic_specs(k)])
    res.ratios["vs_raw_ceiling"] = res.figures["events_per_s"] / res.baseline["raw_events_per_s"]
    res.goals.update({"events_per_s": ">= 100000", "vs_raw_ceiling": ">= 0.5", "freshness_p99_ms": "< 1000"})
    return res


def _rounds(res: BenchResult, k: KafkaSettings, url: str, raw_url: str, proc: subprocess.Popen[bytes], log: Path,
            batches: list[EventBatch], rounds: int, group: WorkerGroup | None, raw_s: list[float],
            mat_s: list[float], say: Callable[[str], None]) -> list[float]:
    """Interleaved rounds, each on node ids of its own (the same stream, renamed), so that a noisy
    moment of the machine hits every side alike (the figures are medians): the raw COPY, one
    worker, and the group (if any). Returns the group's seconds per round."""
    total = res.details["block_events"]
    group_s: list[float] = []
    for r in range(rounds):
        stream = [msgspec.structs.replace(b, node_id=f"r{r}-{b.node_id}") for b in batches]
        say(f"round {r + 1}/{rounds}: raw COPY of {total:,} rows, then the same stream through "
            f"Kafka and one worker{f', then {group.n} workers' if group else ''} …")
        raw_s.append(raw_ceiling(raw_url, stream)[0])
        targets = {b.node_id: b.events[-1].event_id for b in stream}
        encoded = [(b.node_id.encode(), encode(b)) for b in stream]
        producer = _ready_producer(k)
        t0 = time.monotonic()
        _produce_encoded(k, encoded, producer)
        res.details.setdefault("produce_seconds", []).append(time.monotonic() - t0)
        mat_s.append(_wait(url, targets, proc, log, 600) - t0)
        if group is not None:
            group_s.append(group.drain([msgspec.structs.replace(b, node_id=f"g{r}-{b.node_id}") for b in batches]))
    return group_s


def _wait(url: str, targets: Mapping[NodeId, int], proc: subprocess.Popen[bytes] | Sequence[subprocess.Popen[bytes]],
          log: Path, timeout: float) -> float:
    """Poll (one connection, every 50 ms: the poller must not steal the machine from the
    materializer) until every node's last_event_id reached its target; return that time."""
    import json

    procs = [proc] if isinstance(proc, subprocess.Popen) else list(proc)

    async def run() -> float:
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                done = await conn.fetchval("SELECT count(*) FROM nodes WHERE last_event_id = "
                                           "(($1::jsonb) ->> node_id)::bigint", json.dumps(targets))
                if done == len(targets):
                    return time.monotonic()
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"the materializer exited; see {log}")
                await asyncio.sleep(0.05)
        finally:
            await conn.close()
        raise RuntimeError(f"the materializer did not finish within {timeout:.0f} s; see {log}")

    return asyncio.run(run())


def _freshness(k: KafkaSettings, url: str, batches: list[EventBatch], rate: float, seconds: float) -> list[float]:
    """Produce batches at ``rate`` block events/s (ts = send time); return ingest latencies."""
    import msgspec

    producer = make_producer(k, **{"linger.ms": 1})
    # Fresh node ids, so these batches start their own instances.
    rows_per_batch = [max(1, len(plan([b], {}, {}).history)) for b in batches]
    t0 = time.time()
    sent_rows = 0
    marks: list[str] = []
    for b, n in zip(batches, rows_per_batch, strict=True):
        due = t0 + sent_rows / rate
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        if time.time() - t0 > seconds:
            break
        b2 = msgspec.structs.replace(b, node_id=f"fresh-{b.node_id}", ts=time.time())
        producer.produce(k.events_topic, key=b2.node_id.encode(), value=encode(b2))
        producer.poll(0)
        sent_rows += n
        marks.append(b2.node_id)
    producer.flush(30)
    time.sleep(2.0)  # let the worker commit the tail

    async def fetch() -> list[float]:
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            rows = await conn.fetch("SELECT extract(epoch FROM ingested_at - event_ts) AS lag FROM block_events "
                                    "WHERE node_id LIKE 'fresh-%'")
            return [float(r["lag"]) for r in rows]
        finally:
            await conn.close()

    return asyncio.run(fetch())
