"""Real engine code through a real ``kvflow bridge`` process, Kafka and the materializer.

vLLM 0.33.0's own v1 ``KVCacheManager`` (prefix caching and events on) and ``ZmqEventPublisher``
run on the CPU (``tests/bridge/engines.py``); SGLang 0.5.23's publisher module likewise. After each
scenario ``node_blocks`` for the node must equal the engine's block pool — its cached blocks, as
kvflow hashes recomputed from their tokens — exactly, and ``/v1/route`` with a prompt's token ids
must credit the node with the right ``matched_blocks``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from state_store.config import DatabaseSettings
from tests.bridge.conftest import EngineHTTP, start_bridge
from tests.bridge.engines import (
    EngineProcess,
    SglangEngine,
    VllmEngine,
    expected_kvflow_hashes,
    require,
)
from tests.support import ServiceProcess, free_port, kafka_env, node_row, sql_blocks, wait_for

pytestmark = pytest.mark.integration

BS = 16
PROMPTS = [list(range(100 * i, 100 * i + 3 * BS + 5)) for i in range(1, 9)]  # 3 full blocks each


def node_id() -> str:
    return f"eng-{uuid.uuid4().hex[:8]}"


class Setup:
    """An engine, its HTTP stand-in (metrics, models), and a bridge process for one node."""

    def __init__(self, pipeline: dict[str, Any], engine: EngineProcess, kind: str, *args: str) -> None:
        self.pipeline, self.engine, self.kind = pipeline, engine, kind
        self.db = pipeline["db"]
        self.node = node_id()
        self.http = EngineHTTP(model=f"{kind}-model", num_gpu_blocks=engine.num_blocks, block_size=BS).__enter__()
        events, replay = engine.endpoints
        self.bridge = start_bridge(pipeline, kind, self.node, "--events", events, "--replay", replay,
                                   "--engine-url", self.http.url, "--block-size", str(BS), *args)

    def truth(self) -> set[int]:
        return expected_kvflow_hashes(self.engine.state(), BS)

    def in_sql(self) -> set[int]:
        return set(sql_blocks(self.db, self.node))

    def settle(self, what: str, want: set[int] | None = None) -> set[int]:
        """Wait until node_blocks equals ``want`` (default: the engine's truth); returns it."""
        want = self.truth() if want is None else want
        try:
            wait_for(lambda: self.in_sql() == want, 40, what=what)
        except AssertionError:
            raise AssertionError(f"{what}: sql {len(self.in_sql())} blocks, engine {len(want)}; missing "
                                 f"{len(want - self.in_sql())}, extra {len(self.in_sql() - want)}\n"
                                 f"{self.bridge.tail()}") from None
        return want

    def close(self) -> None:
        self.bridge.stop()
        self.http.__exit__(None)


@pytest.fixture
def vllm_setup(pipeline) -> Iterator[Setup]:
    require("vllm")
    with VllmEngine(block_size=BS, num_blocks=24) as eng:
        s = Setup(pipeline, eng, "vllm")
        try:
            yield s
        finally:
            s.close()


def drive(s: Setup, prompts: list[list[int]], tag: str, **kw: Any) -> None:
    for i, p in enumerate(prompts):
        s.engine.request(f"{tag}-{i}", p, decode=3, **kw)


def test_vllm_pool_equals_node_blocks_through_stores_reuse_evictions_lora_and_reset(vllm_setup, pipeline):
    s = vllm_setup
    wait_for(lambda: node_row(s.db, s.node) is not None, 30, what="the bridge's first heartbeat")
    drive(s, PROMPTS[:3], "a")
    s.settle("three prompts stored")
    drive(s, PROMPTS[:2], "reuse")  # prefix hits: no new blocks but the decode blocks
    drive(s, PROMPTS[3:8], "evict")  # 24 blocks: the oldest are evicted
    s.engine.request("lora", PROMPTS[0], decode=2, lora={"name": "adapterA", "id": 7})
    truth = s.settle("stores, reuse, evictions and a LoRA request")
    assert len(truth) > 10
    row = node_row(s.db, s.node)
    assert (row["model"], row["block_size"], row["url"], row["status"]) == ("vllm-model", BS, s.http.url, "live")
    body, route = routed(pipeline, s.node, PROMPTS[7] + [1, 2, 3])
    assert route["matched_blocks"] == 3  # its three full prompt blocks are cached ...
    assert body["node_id"] == s.node and body["matched_blocks"] == 3  # ... so it is the choice
    s.engine.reset()
    s.engine.request("after-reset", PROMPTS[1], decode=1)
    s.settle("after reset_prefix_cache (AllBlocksCleared: a new instance)")
    assert node_row(s.db, s.node)["instance_id"] != row["instance_id"]


def test_vllm_batches_before_the_bridge_joined_are_replayed_and_a_restart_resets(pipeline):
    require("vllm")
    with VllmEngine(block_size=BS, num_blocks=32) as eng:
        for i, p in enumerate(PROMPTS[:4]):  # published before any subscriber: only the replay has them
            eng.request(f"early-{i}", p, decode=2)
        s = Setup(pipeline, eng, "vllm")
        try:
            eng.request("late", PROMPTS[4], decode=2)  # the first batch the bridge's SUB sees: seq > 0
            s.settle("the early batches recovered from the replay socket")
            first = node_row(s.db, s.node)["instance_id"]
            eng.garbage("frames")
            eng.garbage("payload")
            eng.request("after-garbage", PROMPTS[5], decode=2)
            s.settle("garbage on the stream: counted, nothing lost around it")
            eng.restart()  # seq back to 0, the cache empty
            eng.request("restarted", PROMPTS[6], decode=2)
            s.settle("after the engine restarted")
            assert node_row(s.db, s.node)["instance_id"] != first
        finally:
            s.close()
        log = s.bridge.log_path.read_text()
        assert "engine restarted" in log and "'garbage': 2" in log


def test_vllm_a_gap_the_replay_cannot_fill_gives_a_partial_view_never_a_wrong_one(pipeline):
    require("vllm")
    with VllmEngine(block_size=BS, num_blocks=32, buffer_steps=2) as eng:
        for i, p in enumerate(PROMPTS[:4]):  # more batches than the replay buffer keeps
            eng.request(f"early-{i}", p, decode=2)
        s = Setup(pipeline, eng, "vllm")
        try:
            eng.request("late", PROMPTS[4], decode=2)
            wait_for(lambda: node_row(s.db, s.node) is not None and s.in_sql(), 40, what="the first blocks")
            truth = s.truth()
            got = s.in_sql()
            assert got and got <= truth and got != truth  # a subset: every block credited is on the engine
        finally:
            s.close()


def test_vllm_reset_engine_cache_makes_a_partial_view_exact(pipeline):
    require("vllm")
    with VllmEngine(block_size=BS, num_blocks=32, buffer_steps=2) as eng:
        for i, p in enumerate(PROMPTS[:4]):
            eng.request(f"early-{i}", p, decode=2)
        s = Setup(pipeline, eng, "vllm", "--reset-engine-cache")
        s.http.on_reset = lambda: None  # the reset itself goes to the engine below, as vLLM's API server would
        try:
            eng.request("late", PROMPTS[4], decode=2)
            wait_for(lambda: s.http.resets >= 1, 30, what="the bridge to ask for a cache reset")
            eng.reset()  # what vLLM does on POST /reset_prefix_cache: AllBlocksCleared goes out with the next step
            eng.request("exact", PROMPTS[5], decode=2)
            s.settle("an exact view after the engine's cache was emptied")
        finally:
            s.close()


def test_sglang_publisher_through_the_bridge(pipeline):
    require("sglang")
    with SglangEngine(block_size=BS, num_blocks=24) as eng:
        s = Setup(pipeline, eng, "sglang")
        try:
            drive(s, PROMPTS[:6], "s")
            s.settle("SGLang's blocks (signed hashes, optional fields left out)")
        finally:
            s.close()


def routed(pipeline: dict[str, Any], node: str, token_ids: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``POST /v1/route`` on a router process reading the pipeline's database: the answer and the
    node's candidate in it."""
    reader_role = make_url(DatabaseSettings().reader())
    reader = make_url(pipeline["db"]).set(username=reader_role.username, password=reader_role.password)
    port = free_port()
    router = ServiceProcess(["router", "--port", str(port), "--log-level", "warning"],
                            {**kafka_env(pipeline["kafka"]),
                             "KVFLOW_DATABASE_READER_URL": reader.render_as_string(hide_password=False)},
                            pipeline["tmp"] / f"router-{node}.log").start()
    try:
        def ask() -> tuple[dict[str, Any], dict[str, Any]] | None:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/route", json={"token_ids": token_ids}, timeout=2)
            except httpx.HTTPError:
                return None
            cands = [c for c in r.json().get("candidates", []) if c["node_id"] == node]
            return (r.json(), cands[0]) if cands and r.status_code == 200 and cands[0]["eligible"] else None

        return wait_for(ask, 60, what="the router's answer")
    finally:
        router.stop()
