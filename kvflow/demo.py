"""``kvflow demo``: the whole system on one machine, a realistic workload, a summary.

It starts (or reuses) the local stack, applies migrations, starts the materializer, the router and
two CPU inference nodes as separate processes, and drives a workload through the router
(:mod:`kvflow.demo_workload`): a few long shared system prompts pinned at priority 100, multi-turn
conversations whose history grows, and one-off questions. The nodes serve a real model
(``--model smollm2-135m``: pulled once, chats with real answers) or random weights. It ends with a
summary (requests, cached-token share, time to first token cold and with a cached prefix, routing
choices, events published and materialized, materializer lag, a real model's answers), the
dashboard's URL and a line of SQL.
The services run under a :class:`~kvflow.supervise.Supervisor`: one that dies is reported (exit
status, last log lines) and restarted with backoff while the others keep running. SIGINT
(Ctrl-C), SIGTERM, SIGHUP, or the end of the run stop everything it started; killed outright,
its children notice and stop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvflow import demo_workload
from kvflow.demo_workload import DemoResult, Request
from kvflow.stack import Stack, port_open
from kvflow.supervise import Child, Supervisor, exit_status, kvflow_argv, signals_stop
from state_store.config import DatabaseSettings, plain_dsn


@dataclass
class Service:
    name: str
    child: Child
    url: str | None = None


def _free(port: int) -> int:
    while port_open(port):
        port += 1
    return port


class Demo:
    def __init__(self, console: Console, *, requests: int = 90, concurrency: int = 4, nodes: int = 2,
                 use_local_stack: bool = True, log_dir: Path | None = None, model_dir: Path | None = None) -> None:
        self.console = console
        self.requests = requests
        #: a real model's folder (None: the random-weight preset)
        self.model_dir = model_dir
        self.concurrency = concurrency
        self.n_nodes = nodes
        self.use_local_stack = use_local_stack
        self.started_stack = False
        self.stack = Stack()
        self.services: list[Service] = []
        self.log_dir = log_dir or self.stack.paths.logs / "demo"
        self.env = dict(os.environ)
        # No restarts while starting: a service that cannot start says so at once (start()).
        self.supervisor = Supervisor(lambda m: console.print(f"[yellow]{m}[/]", highlight=False), restart=False)

    # ------------------------------------------------------------------ processes

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, url: str | None = None) -> None:
        child = self.supervisor.spawn(name, kvflow_argv(*args), self.log_dir / f"{name}.log",
                                      {**self.env, **(env or {})})
        self.services.append(Service(name, child, url))

    def stop(self) -> None:
        self.supervisor.stop()
        self.services.clear()
        if self.started_stack:
            self.console.print("[dim]stopping the local stack it started …[/]")
            self.stack.down()
            self.started_stack = False

    def _wait_http(self, url: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            exited = self.supervisor.first_exit()
            if exited is not None:
                assert exited.proc is not None
                raise RuntimeError(f"{exited.name} exited ({exit_status(exited.proc.returncode)}); "
                                   f"see {exited.log}")
            time.sleep(0.3)
        raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")

    # ------------------------------------------------------------------ the run

    def start(self, say: Callable[[str], None]) -> tuple[str, list[str]]:
        if self.use_local_stack:
            was_up = all(s.state in ("running", "external") for s in self.stack.status())
            self.stack.up(say)
            self.started_stack = not was_up
        say("applying migrations …")
        from migrations import upgrade

        upgrade("head")
        from eventbus.config import KafkaSettings
        from eventbus.kafka import ensure_topics

        ensure_topics(KafkaSettings())
        say("starting the materializer …")
        self._spawn("materializer", ["materializer", "--loglevel", "warn"],
                    {"KVFLOW_MATERIALIZER_GROUP_ID": "kvflow-materializer",
                     "KVFLOW_MATERIALIZER_WEB_PORT": str(_free(6066))})
        node_urls = []
        port = 8101
        for i in range(self.n_nodes):
            port = _free(port)
            name = f"demo-node-{chr(ord('a') + i)}"
            url = f"http://127.0.0.1:{port}"
            say(f"starting {name} on {url} …")
            model = ["--model-dir", str(self.model_dir)] if self.model_dir else ["--model-preset", "small"]
            self._spawn(name, ["node", "--node-id", name, "--port", str(port), "--num-blocks", "384",
                               "--host-blocks", "512", *model, "--log-level", "warning"],
                        {"KVFLOW_NODE_SEED": "0"}, url)
            node_urls.append(url)
            port += 1
        router_port = _free(8000)
        router = f"http://127.0.0.1:{router_port}"
        say(f"starting the router on {router} …")
        # The router tokenizes as the nodes do (a real model's tokenizer.json), to route by their blocks.
        tokenizer = {"KVFLOW_ROUTER_TOKENIZER_DIR": str(self.model_dir)} if self.model_dir else None
        self._spawn("router", ["router", "--port", str(router_port), "--log-level", "warning"], tokenizer, router)
        for url in [*node_urls, router]:
            self._wait_http(f"{url}/healthz")
        say("waiting until the router can route to both nodes …")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # NOTE: what a request sees: the router's own view (its nodes cache), in which a node is
            # eligible once it is live and its heartbeat has said where it listens. (Live in
            # PostgreSQL is not enough: its events may come before its first heartbeat.)
            answer = httpx.post(f"{router}/v1/route", json={"prompt": "ping"}, timeout=5).json()
            eligible = [c for c in answer.get("candidates", [])
                        if c["eligible"] and c["node_id"].startswith("demo-node-")]
            if len(eligible) >= self.n_nodes:
                break
            time.sleep(0.3)
        else:
            raise RuntimeError("the router cannot route to the nodes; see the materializer's log")
        for svc in self.services:
            say(f"{svc.name}: pid {svc.child.pid}" + (f", {svc.url}" if svc.url else ""))
        self.supervisor.restart = True  # from now on a service that dies is restarted
        return router, node_urls

    def workload(self) -> Iterator[Request]:
        """The requests: chats with real questions for a real model, else text prompts."""
        if self.model_dir is not None:
            return demo_workload.chats(self.requests, self.model_dir, self.model_dir.name)
        return demo_workload.completions(self.requests)

    async def drive(self, router: str, progress: Progress) -> DemoResult:
        res = DemoResult()
        task = progress.add_task("requests through the router", total=self.requests)
        queue: asyncio.Queue[Request] = asyncio.Queue()
        for item in self.workload():
            queue.put_nowait(item)
        async with httpx.AsyncClient(base_url=router, timeout=300) as client:
            async def worker() -> None:
                while not queue.empty():
                    kind, path, body = queue.get_nowait()
                    await demo_workload.send(client, kind, path, body, res)
                    progress.advance(task)

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return res

    async def pipeline_figures(self, node_urls: list[str]) -> dict[str, Any]:
        emitted = {}
        await asyncio.sleep(1.0)  # the nodes publish what the last requests queued
        async with httpx.AsyncClient(timeout=10) as client:
            for url in node_urls:
                st = (await client.get(f"{url}/v1/kv/stats")).json()
                emitted[st["node_id"]] = st["last_event_id"]
        published = sum(e + 1 for e in emitted.values())
        db = DatabaseSettings()
        conn = await asyncpg.connect(plain_dsn(db.writer()))
        try:
            deadline = time.monotonic() + 20
            while True:
                rows = await conn.fetch("SELECT node_id, last_event_id FROM nodes WHERE node_id = ANY($1::text[])",
                                        list(emitted))
                applied = {r["node_id"]: r["last_event_id"] for r in rows}
                lag = sum(max(0, emitted[n] - applied.get(n, -1)) for n in emitted)
                if lag == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            # This run's instances only: the same node ids may have history from earlier demos.
            this_run = ("(node_id, instance_id) IN "
                        "(SELECT node_id, instance_id FROM nodes WHERE node_id = ANY($1::text[]))")
            history = await conn.fetchval(f"SELECT count(*) FROM block_events WHERE {this_run}", list(emitted))
            events = await conn.fetchval("SELECT count(DISTINCT (node_id, instance_id, event_id)) FROM block_events "
                                         f"WHERE {this_run}", list(emitted))
            pinned = await conn.fetchval("SELECT count(*) FROM node_blocks WHERE priority = 100 AND "
                                         "node_id = ANY($1::text[])", list(emitted))
        finally:
            await conn.close()
        return {"published": published, "materialized": events, "history_rows": history, "lag_events": lag,
                "pinned_blocks": pinned}


def run_demo(console: Console, *, requests: int = 90, keep: bool = False, use_local_stack: bool = True,
             model_dir: Path | None = None) -> int:
    demo = Demo(console, requests=requests, use_local_stack=use_local_stack, model_dir=model_dir)

    def say(m: str) -> None:
        console.print(f"[dim]{m}[/]")

    with signals_stop():  # SIGINT, SIGTERM and SIGHUP stop everything it started (finally)
        try:
            router, node_urls = demo.start(say)
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console) as progress:
                t0 = time.monotonic()
                res = asyncio.run(demo.drive(router, progress))
                elapsed = time.monotonic() - t0
            figures = asyncio.run(demo.pipeline_figures(node_urls))
            _summary(console, res, figures, elapsed, router)
            if keep:
                console.print("\nthe services keep running (a service that dies is restarted); "
                              "Ctrl-C, SIGTERM or SIGHUP stops them")
                while True:
                    time.sleep(3600)
            return 0 if res.failed == 0 else 1
        except KeyboardInterrupt as exc:  # Ctrl-C, or a stop signal (kvflow.supervise.Stopped)
            console.print(f"\n{exc or 'interrupted'}: stopping what the demo started …")
            return 130
        finally:
            demo.stop()


def _summary(console: Console, res: DemoResult, f: dict[str, Any], elapsed: float, router: str) -> None:
    t = Table(title="kvflow demo", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    share = res.cached_tokens / res.prompt_tokens if res.prompt_tokens else 0.0
    t.add_row("requests (failed)", f"{res.requests} ({res.failed})")
    for error, n in res.errors.most_common(3):
        t.add_row(f"  failed {n}x", error[:80])
    t.add_row("requests per second", f"{res.requests / elapsed:.1f}")
    t.add_row("prompt tokens / served from cache", f"{res.prompt_tokens:,} / {res.cached_tokens:,} ({share:.0%})")
    for kind in ("system prompt", "conversation", "one-off"):
        p, c = res.prompt_by_kind[kind], res.cached_by_kind[kind]
        t.add_row(f"  {kind} ({res.by_kind[kind]} requests)", f"{c / p:.0%} cached" if p else "-")
    t.add_row("time to first token p50, nothing cached", _p50(res.ttft_cold))
    t.add_row("time to first token p50, a prefix cached", _p50(res.ttft_cached))
    for node, n in sorted(res.by_node.items()):
        t.add_row(f"routed to {node}", str(n))
    t.add_row("events emitted by the nodes", f"{f['published']:,}")
    t.add_row("events materialized in PostgreSQL", f"{f['materialized']:,} ({f['history_rows']:,} block rows)")
    t.add_row("materializer lag (events)", str(f["lag_events"]))
    t.add_row("blocks pinned at priority 100", str(f["pinned_blocks"]))
    console.print(t)
    for question, answer in res.answers[:3]:
        console.print(f"[bold]Q:[/] {question}\n[bold]A:[/] {answer}", highlight=False)
    console.print(f"dashboard: {router}/dashboard (while the services run: kvflow demo --keep)")
    console.print("try: psql postgresql://kvflow_reader:kvflow_reader@localhost:55432/kvflow "
                  "-c 'SELECT * FROM node_cache_summary'", highlight=False)


def _p50(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} s ({len(values)} requests)"
