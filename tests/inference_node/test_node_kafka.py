"""A real node process: HTTP requests in, the expected events on a real Kafka topic out."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest

from eventbus import protocol as p
from eventbus.kafka import make_consumer
from eventbus.replay import NodeState
from tests.support import ServiceProcess, free_port, kafka_env, wait_for

pytestmark = pytest.mark.integration


def start_node(kafka_settings, tmp_path, node_id: str, env: dict[str, str] | None = None,
               **flags: str) -> tuple[ServiceProcess, str]:
    port = free_port()
    args = ["node", "--node-id", node_id, "--port", str(port), "--model-preset", "tiny", "--log-level", "warning"]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}", v]
    proc = ServiceProcess(args, {**kafka_env(kafka_settings), "KVFLOW_NODE_HEARTBEAT_S": "0.5", **(env or {})},
                          tmp_path / f"{node_id}.log").start()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            assert proc.alive(), proc.tail()
            return False

    wait_for(healthy, 60, what="the node to answer")
    return proc, url


def read_events(consumer, until_id: int, timeout: float = 30) -> list[p.Event]:
    events: list[p.Event] = []
    deadline = time.monotonic() + timeout
    while (not events or events[-1].event_id < until_id) and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None or msg.error() is not None:
            continue
        events.extend(p.decode_batch(msg.value()).events)
    return events


def test_requests_become_the_expected_events_and_the_state_matches(kafka_settings, tmp_path):
    proc, url = start_node(kafka_settings, tmp_path, "node-int", num_blocks="16", host_blocks="8",
                           block_size="16")
    consumer = make_consumer(kafka_settings, group_id="t-node-events")
    consumer.subscribe([kafka_settings.events_topic])
    try:
        def complete(tokens: list[int], prio: int | None) -> dict:
            body: dict = {"prompt": tokens, "max_tokens": 1}
            if prio is not None:
                body["kv_retention"] = {"token_ranges": [{"start": 0, "end": None, "priority": prio}]}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        system = list(range(64))
        complete(system, 100)                                # 4 blocks at 100
        complete([1] * 48, 10)                               # 3 blocks at 10 (A)
        complete([2] * 48, 10)                               # 3 blocks at 10 (B)
        complete([3] * 48, 50)                               # 3 blocks at 50
        complete([4] * 48, 50)                               # 3 blocks at 50: the 16 GPU blocks are full
        complete([5] * 48, None)                             # 3 at 35: evicts the lowest (10)
        complete([6] * 96, 35)                               # 6 more: the rest of the 10s, then offloads
        again = complete(system, None)                       # the system prompt is still there, on the GPU
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 63

        state = httpx.get(f"{url}/v1/kv/state", timeout=10).json()
        events = read_events(consumer, state["last_event_id"])
        assert events[0].data == p.Created(num_blocks_per_cache_level=[16, 8])
        assert isinstance(events[1].data, p.Snapshot) and events[1].data.blocks == []
        assert [e.event_id for e in events] == list(range(len(events)))

        stored = {b.block_hash: b.priority for e in events if isinstance(e.data, p.Stored) for b in e.data.blocks}
        first_stored = next(e.data for e in events if isinstance(e.data, p.Stored))
        assert [b.priority for b in first_stored.blocks] == [100, 100, 100, 100]

        removed = [h for e in events if isinstance(e.data, p.Removed) for h in e.data.block_hashes]
        offloaded = [e.data.block_hash for e in events
                     if isinstance(e.data, p.Updated) and e.data.cache_level == p.LevelDiff(old=0, new=1)]
        # Pressure takes the priority-10 blocks first (removed: below the offload threshold) ...
        assert [stored[h] for h in removed[:6]] == [10] * 6
        # ... then offloads (priority >= 35) to the host tier ...
        assert offloaded and all(stored[h] >= 35 for h in offloaded)
        # ... and never touches the pinned system prompt.
        system_hashes = {b.block_hash for b in first_stored.blocks}
        assert not system_hashes & (set(removed) | set(offloaded))

        rebuilt = NodeState().apply_all(events)
        assert rebuilt.last_event_id == state["last_event_id"]
        assert rebuilt.blocks == NodeState.from_snapshot_blocks(
            p.SnapshotBlock(**b) for b in state["blocks"])
    finally:
        consumer.close()
        proc.stop()


def test_heartbeats_arrive_on_node_stats(kafka_settings, tmp_path):
    proc, url = start_node(kafka_settings, tmp_path, "node-hb", num_blocks="8")
    consumer = make_consumer(kafka_settings, group_id="t-node-stats")
    consumer.subscribe([kafka_settings.stats_topic])
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": list(range(40)), "max_tokens": 2}, timeout=30)
        beats: list[p.NodeStats] = []
        deadline = time.monotonic() + 20
        while len(beats) < 3 and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                beats.append(p.decode_stats(msg.value()))
        assert len(beats) >= 3
        assert all(b.node_id == "node-hb" and b.url == url and b.block_size == 32 for b in beats)
        assert beats[-1].capacity == [8, 0] and beats[-1].counters.prompt_tokens == 40
        gaps = [b2.ts - b1.ts for b1, b2 in itertools.pairwise(beats)]
        assert max(gaps) <= 2.0
    finally:
        consumer.close()
        proc.stop()
