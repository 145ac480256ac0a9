"""Soak: a sustained event rate and concurrent routed requests for a bounded time.

No errors, memory of every service within a bound, materializer lag bounded.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.inference_node.test_node_kafka import start_node
from tests.support import (
    CoreNode,
    ServiceProcess,
    free_port,
    history_duplicates,
    http_ok,
    materializer,
    node_row,
    sql_blocks,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOAK_S = float(os.environ.get("KVFLOW_SOAK_S", "60"))
#: The materializer is done with the backlog this soon after the load stops (seconds).
CATCH_UP_S = 15.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_soak(kafka_settings, migrated_database_url, reader_url, tmp_path):
    db = migrated_database_url
    mat = materializer(kafka_settings, db, tmp_path).start()
    node, _node_url = start_node(kafka_settings, tmp_path, "soak-node", num_blocks="128", host_blocks="64")
    port = free_port()
    router = ServiceProcess(["router", "--port", str(port), "--log-level", "warning"],
                            {"KVFLOW_DATABASE_READER_URL": reader_url}, tmp_path / "router.log").start()
    base = f"http://127.0.0.1:{port}"
    synthetic = CoreNode(kafka_settings, "soak-events", gpu=256, host=128, seed=11)
    errors: list[str] = []
    stop = threading.Event()
    try:
        wait_for(lambda: http_ok(f"{base}/healthz"), 60, what="the router")
        wait_for(lambda: node_row(db, "soak-node") is not None, 60, what="the node in SQL")

        def events() -> None:  # ~2,000 events/s from an in-process KV core
            while not stop.is_set():
                t0 = time.monotonic()
                synthetic.run(400)
                time.sleep(max(0.0, 0.2 - (time.monotonic() - t0)))

        def requests(worker: int) -> int:
            n = 0
            with httpx.Client(base_url=base, timeout=60) as client:
                while not stop.is_set():
                    body = {"prompt": f"soak system prompt {worker % 2}. " * 10 + f"q{n}", "max_tokens": 4}
                    r = client.post("/v1/completions", json=body)
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {r.text[:200]}")
                    n += 1
            return n

        pids = {"materializer": mat.proc.pid, "node": node.proc.pid, "router": router.proc.pid}
        start = {k: rss_mb(v) for k, v in pids.items()}
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            gen = pool.submit(events)
            workers = [pool.submit(requests, i) for i in range(4)]
            mid: dict[str, float] = {}
            time.sleep(SOAK_S / 3)
            mid = {k: rss_mb(v) for k, v in pids.items()}
            time.sleep(SOAK_S * 2 / 3)
            stop.set()
            done = sum(w.result() for w in workers)
            gen.result()
        end = {k: rss_mb(v) for k, v in pids.items()}
        synthetic.finish()

        assert not errors, errors[:5]
        assert done > 50
        # Memory: after warm-up (a third of the run), growth stays small.
        for k in pids:
            assert end[k] - mid[k] < 100, (k, start[k], mid[k], end[k])
        # Lag: the materializer catches up within seconds of the load stopping (waited for longer,
        # so that a slow catch-up fails the bound below rather than the wait), and what it wrote
        # is exactly the synthetic core's cache, with every event once in the history.
        t0 = time.monotonic()
        wait_for(lambda: (r := node_row(db, "soak-events")) is not None
                 and r["last_event_id"] == synthetic.core.last_event_id, 4 * CATCH_UP_S,
                 what="the materializer to catch up")
        caught_up_s = time.monotonic() - t0
        assert caught_up_s < CATCH_UP_S, f"caught up {caught_up_s:.1f} s after the load stopped"
        row = node_row(db, "soak-events")
        assert row["instance_id"] == synthetic.instance_id and row["status"] in ("live", "stale"), dict(row)
        assert sql_blocks(db, "soak-events") == synthetic.truth()
        assert history_duplicates(db, "soak-events") == 0
        print(f"soak: {done} routed requests, {synthetic.core.last_event_id + 1} synthetic events, caught up in "
              f"{caught_up_s:.1f} s; "
              f"RSS MiB start/mid/end {start} {mid} {end}")
    finally:
        stop.set()
        router.stop()
        node.stop()
        mat.stop()
