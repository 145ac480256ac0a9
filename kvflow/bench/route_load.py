"""The router under load, for ``kvflow bench route`` (and ``--fleet``): a ``kvflow router``
subprocess of ``workers`` processes on a free port, and ``n`` decisions sent to it over
keep-alive connections by the lean HTTP client of ``kvflow.bench.httpload`` (on uvloop), with
the router's own ``decision_ms`` of each."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import msgspec

from kvflow.bench.httpload import LoadResult, post_load
from kvflow.stack import free_port
from kvflow.supervise import kvflow_argv, spawn_child, stop_groups

PROJECT = Path(__file__).resolve().parents[2]


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop (installed with uvicorn[standard]) for the load generator: ~40 % less client CPU."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it on Linux
        return None
    return uvloop.new_event_loop


def _load(port: int, bodies: list[bytes], n: int, concurrency: int) -> tuple[LoadResult, list[float]]:
    """``n`` decisions, ``concurrency`` keep-alive connections; the result and the router's own
    ``decision_ms`` of each (seconds)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        res = runner.run(post_load("127.0.0.1", port, "/v1/route", bodies, n, concurrency))
    return res, [msgspec.json.decode(b)["decision_ms"] / 1000 for b in res.bodies]


@contextmanager
def _router(reader: str, workers: int, extra_env: dict[str, str] | None = None) -> Iterator[int]:
    """A ``kvflow router`` subprocess with ``workers`` processes, answering on the yielded port."""
    port = free_port()
    env = {**os.environ, "KVFLOW_DATABASE_READER_URL": reader, **(extra_env or {})}
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvflow-bench-route-{port}.log"
    proc = spawn_child(kvflow_argv("router", "--port", str(port), "--workers", str(workers), "--log-level", "warning"),
                       log, env, PROJECT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the router did not start; see {log}")
            time.sleep(0.2)
        yield port
    finally:
        stop_groups([proc], 30)
