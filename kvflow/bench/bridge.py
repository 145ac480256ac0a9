"""``kvflow bench bridge``: how fast one bridge translates a real vLLM publisher's events into Kafka.

A publisher process — vLLM's own ``ZmqEventPublisher`` and ``KVEventBatch``/``BlockStored``/
``BlockRemoved`` structs when vLLM is installed (``make engines``), else kvflow's own encoding of
the same wire — publishes a KV cache's life: batches of stored chains of blocks of 16 tokens, and
the removals that keep the cache at ``cache_blocks``. Measured in the same run:

* ``baseline.publisher_blocks_per_s``: the publisher's own rate, to a plain SUB socket that only
  counts what arrives (the limit: ZMQ and the engine's msgpack encoding);
* ``figures.bridge_blocks_per_s``: stored and removed blocks a :class:`~bridge.service.Bridge`
  (its ZMQ source, translator, publisher and Kafka producer, in this process) turns into delivered
  Kafka messages per second, from the first batch received to the last message acknowledged;
* ``figures.bridge_core_share_at_10k``: the share of one core the bridge's process uses while
  the publisher sends 10,000 blocks/s (CPU time over wall time: never the engine's bottleneck);
* ``ratios.bridge_vs_publisher``.

Goal: ≥ 100,000 blocks/s, and a small share of one core at 10,000 blocks/s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from bridge.engine_http import EngineClient
from bridge.service import Bridge, BridgeSettings
from bridge.zmq_source import ZmqSource
from eventbus.config import KafkaSettings
from eventbus.kafka import delete_topics, ensure_topics, topic_specs
from eventbus.protocol import NodeId
from kvflow.bench.harness import BenchResult, interleaved
from kvflow.stack import StackError

BLOCK = 16

# The publisher, run as its own process: vLLM's structs and publisher when importable.
PUBLISHER = r"""
import json, sys, time
endpoint, batches, events, blocks, cache, rate = sys.argv[1], *map(float, sys.argv[2:7])
batches, events, blocks, cache = int(batches), int(events), int(blocks), int(cache)
try:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
    kind = "vllm"
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=None, buffer_steps=16, hwm=1_000_000,
                            max_queue_size=1_000_000)
    send = pub.publish
    def batch(evs): return KVEventBatch(ts=time.time(), events=evs)
except ImportError:
    import msgspec, zmq
    kind = "kvflow"
    sock = zmq.Context().socket(zmq.PUB); sock.setsockopt(zmq.SNDHWM, 1_000_000); sock.bind(endpoint)
    seq = 0
    def BlockStored(**kw): return {"type": "BlockStored", **kw}
    def BlockRemoved(**kw): return {"type": "BlockRemoved", **kw}
    def batch(evs): return [time.time(), evs, 0]
    def send(b):
        global seq
        sock.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(b)]); seq += 1
    pub = None
print(json.dumps({"kind": kind}), flush=True)
sys.stdin.readline()  # the subscriber is connected
stored = []
t0 = time.perf_counter()
n = 0
for i in range(batches):
    evs = []
    for e in range(events):
        base = (i * events + e) * blocks
        hashes = list(range(base + 1, base + blocks + 1))
        toks = [(base * BLOCKSIZE + t) % 100_000 for t in range(blocks * BLOCKSIZE)]
        evs.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks, block_size=BLOCKSIZE,
                               lora_id=None, medium="GPU", lora_name=None))
        stored.extend(hashes)
        n += blocks
    if len(stored) > cache:
        old, stored[:] = stored[:len(stored) - cache], stored[len(stored) - cache:]
        evs.append(BlockRemoved(block_hashes=old, medium="GPU"))
        n += len(old)
    send(batch(evs))
    if rate > 0:
        lag = n / rate - (time.perf_counter() - t0)
        if lag > 0:
            time.sleep(lag)
if pub is not None:
    pub.shutdown()
print(json.dumps({"seconds": time.perf_counter() - t0, "blocks": n, "batches": batches}), flush=True)
sys.stdin.readline()
""".replace("BLOCKSIZE", str(BLOCK))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Publisher:
    """The publisher process for one run (``rate`` 0: as fast as it can)."""

    def __init__(self, batches: int, events: int, blocks: int, cache: int, rate: float) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PUBLISHER, f"tcp://*:{self.port}", str(batches), str(events), str(blocks),
             str(cache), str(rate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.kind = json.loads(self.proc.stdout.readline() or '{"kind": "failed"}')["kind"]
        self.url = f"tcp://127.0.0.1:{self.port}"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {}

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _publisher_alone(shape: tuple[int, int, int, int]) -> float:
    """Blocks/s a plain SUB receives from the publisher (the baseline)."""
    batches, events, blocks, cache = shape
    pub = _Publisher(batches, events, blocks, cache, 0)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(pub.url)
    try:
        time.sleep(0.5)  # the SUB joins before anything is sent
        pub.go()
        got = 0
        first = 0.0
        while got < batches and sub.poll(10_000):
            sub.recv_multipart()
            got += 1
            if got == 1:
                first = time.perf_counter()
        elapsed = time.perf_counter() - first
        done = pub.result()
    finally:
        sub.close()
        ctx.term()
        pub.close()
    return float(done.get("blocks", 0)) / max(elapsed, 1e-9) if got == batches else 0.0


def _through_bridge(shape: tuple[int, int, int, int], kafka: KafkaSettings, rate: float = 0) -> dict[str, float]:
    """One run through a bridge in this process: blocks/s, and the CPU share over the run."""
    batches, events, blocks, cache = shape
    pub = _Publisher(batches, events, blocks, cache, rate)
    from eventbus.publisher import KafkaSink

    sink = KafkaSink(kafka, NodeId("bench-bridge"))
    source = ZmqSource(pub.url, None)
    settings = BridgeSettings(node_id=NodeId("bench-bridge"), num_blocks=cache, block_size=BLOCK, events=pub.url,
                              max_keys=cache * 2)
    bridge = Bridge(settings, sink, EngineClient("vllm", "http://127.0.0.1:9"), source)
    try:
        time.sleep(0.5)
        pub.go()
        while bridge.stats.batches == 0:
            bridge.step(1.0)
        t0, c0 = time.perf_counter(), time.process_time()
        while bridge.stats.batches < batches:
            bridge.step(1.0)
        bridge.pump()
        sink.flush(60)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        done = pub.result()
    finally:
        source.close()
        sink.close()
        pub.close()
    moved = bridge.stats.stored_blocks + bridge.stats.removed_blocks
    assert moved == done.get("blocks"), (moved, done)
    return {"blocks_per_s": moved / wall, "core_share": cpu / wall, "kind_vllm": float(pub.kind == "vllm")}


def bench_bridge(*, batches: int = 400, events: int = 8, blocks: int = 32, cache: int = 50_000, repeats: int = 3,
                 rate_run_s: float = 5.0, warmup: int = 1, say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """See the module docstring. Each batch stores ``events`` chains of ``blocks`` blocks; ``warmup``
    rounds of both first (each round starts the publisher's processes: seconds with vLLM's modules)."""
    res = BenchResult("bridge")
    suffix = uuid.uuid4().hex[:8]
    k = KafkaSettings().model_copy(update={"events_topic": f"bench-bridge-events-{suffix}",
                                           "stats_topic": f"bench-bridge-stats-{suffix}",
                                           "dlq_topic": f"bench-bridge-dlq-{suffix}",
                                           "control_topic": f"bench-bridge-control-{suffix}"})
    try:
        ensure_topics(k)
    except Exception as exc:  # any Kafka failure: say where to start it
        raise StackError(f"Kafka at {k.bootstrap} is not reachable ({exc}); run `kvflow stack up`") from exc
    shape = (batches, events, blocks, cache)
    kinds: list[float] = []
    try:
        say(f"{batches} batches of {events} x {blocks} blocks of {BLOCK} tokens, {repeats} interleaved rounds …")

        def bridged() -> float:
            r = _through_bridge(shape, k)
            kinds.append(r["kind_vllm"])
            return r["blocks_per_s"]

        runs = interleaved({"publisher": lambda: _publisher_alone(shape), "bridge": bridged}, warmup=warmup,
                           repeats=repeats)
        per_batch = events * blocks
        rate_batches = max(10, int(10_000 * rate_run_s / per_batch))
        say(f"at 10,000 blocks/s for ~{rate_run_s:.0f} s …")
        paced = _through_bridge((rate_batches, events, blocks, cache), k, rate=10_000)
    finally:
        delete_topics(k, [t.name for t in topic_specs(k)])
    res.figures["bridge_blocks_per_s"] = runs["bridge"].median
    res.figures["bridge_core_share_at_10k"] = paced["core_share"]
    res.baseline["publisher_blocks_per_s"] = runs["publisher"].median
    res.ratios["bridge_vs_publisher"] = runs["bridge"].median / max(runs["publisher"].median, 1e-9)
    res.goals["bridge_blocks_per_s"] = ">= 100000"
    res.goals["bridge_core_share_at_10k"] = "small (< 0.5 of one core)"
    res.details.update({"publisher": "vllm.distributed.kv_events.ZmqEventPublisher" if all(kinds) and kinds
                        else "kvflow's encoding of the same wire (vLLM not installed)",
                        "block_tokens": BLOCK, "batches": batches, "events_per_batch": events,
                        "blocks_per_event": blocks, "cache_blocks": cache,
                        "bridge": runs["bridge"].as_dict(), "publisher_alone": runs["publisher"].as_dict(),
                        "paced_10k": paced})
    return res
