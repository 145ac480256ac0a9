"""The ``kvflow`` command line.

Every sub-command is a thin shell over a library function: it parses flags, calls, and prints.
Errors the user can fix are printed in one line (``kvflow <cmd>: …``) with exit status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError

from kvflow.stack import ServiceStatus, Stack, StackError, StackSettings, redact_url
from kvflow.supervise import Stopped, follow_parent, signals_stop

app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="kvflow: see and use the KV cache of an LLM inference fleet.",
)
stack_app = typer.Typer(no_args_is_help=True, help="The local development stack (Kafka + PostgreSQL).")
db_app = typer.Typer(no_args_is_help=True, help="Database schema migrations (Alembic).")
app.add_typer(stack_app, name="stack")
topics_app = typer.Typer(no_args_is_help=True, help="Kafka topics of kvflow.")
app.add_typer(db_app, name="db")
app.add_typer(topics_app, name="topics")

console = Console()
err = Console(stderr=True)
T = TypeVar("T")


def _fail(cmd: str, message: str) -> None:
    err.print(f"[bold red]kvflow {cmd}:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [""])[0]


def guarded(cmd: str, fn: Callable[[], T]) -> T:
    """Run fn; a StackError (or another expected failure) becomes one line and exit 1."""
    try:
        return fn()
    except StackError as exc:
        _fail(cmd, str(exc))
    except (OSError, SQLAlchemyError) as exc:
        if os.environ.get("KVFLOW_DEBUG"):
            raise
        _fail(cmd, f"{type(exc).__name__}: {_first_line(exc)} (KVFLOW_DEBUG=1 for the traceback)")
    except Stopped as exc:
        _fail(cmd, f"stopped by {exc}")
    except KeyboardInterrupt:
        _fail(cmd, "interrupted")
    raise AssertionError("unreachable")


@stack_app.command("up")
def stack_up(
    brokers: Annotated[int | None, typer.Option(
        "--brokers", min=1, max=9,
        help="Kafka brokers (KRaft, each broker + controller): 3 gives topics 3 replicas and "
             "min.insync.replicas=2. Default: as the stack was formatted, else 1.")] = None,
    replica: Annotated[bool | None, typer.Option(
        "--replica/--no-replica",
        help="A PostgreSQL streaming standby (KVFLOW_STACK_REPLICA_PORT, 55433) for routers to read. "
             "Default: if one was made before.")] = None,
) -> None:
    """Start Apache Kafka (KRaft) and PostgreSQL; a no-op for what already runs."""
    settings = StackSettings()
    if brokers is not None:
        settings.kafka_brokers = brokers
    if replica is not None:
        settings.replica = replica
    stack = Stack(settings)

    def up() -> dict[str, str]:
        with signals_stop():  # a stop signal ends its helper commands (subprocess.run kills them)
            return stack.up(say=lambda m: console.print(f"[dim]{m}[/]"))

    result = guarded("stack up", up)
    for name, state in result.items():
        console.print(f"[green]{name}[/]: {state}")
    _print_status(stack)


@stack_app.command("down")
def stack_down() -> None:
    """Stop exactly what `kvflow stack up` started."""
    stack = Stack()
    result = guarded("stack down", stack.down)
    for name, state in result.items():
        console.print(f"{name}: {state}")


@stack_app.command("status")
def stack_status(
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless every service runs.")] = False,
) -> None:
    """Say what runs where."""
    stack = Stack()
    statuses = _print_status(stack)
    if check and any(s.state not in ("running", "external") for s in statuses):
        raise typer.Exit(1)


def _print_status(stack: Stack) -> list[ServiceStatus]:
    table = Table(title="kvflow local stack")
    for col in ("service", "state", "address", "pid", "detail"):
        table.add_column(col)
    statuses = guarded("stack status", stack.status)
    for s in statuses:
        color = {"running": "green", "external": "cyan"}.get(s.state, "yellow")
        table.add_row(s.name, f"[{color}]{s.state}[/]", s.address, str(s.pid or "-"), s.detail)
    console.print(table)
    console.print(f"KVFLOW_KAFKA_BOOTSTRAP={stack.kafka.address}", highlight=False)
    console.print(f"KVFLOW_DATABASE_URL={redact_url(stack.database_url)}", highlight=False)
    if stack.wants_replica:
        console.print(f"KVFLOW_DATABASE_READER_URL={redact_url(stack.reader_url)}", highlight=False)
    return statuses


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    url: Annotated[str | None, typer.Option(help="Database URL (default: KVFLOW_DATABASE_URL).")] = None,
) -> None:
    """Apply migrations up to REVISION (default: head)."""
    from migrations import upgrade

    guarded("db upgrade", lambda: upgrade(revision, url=url))
    console.print(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision, e.g. -1 or base.")],
    url: Annotated[str | None, typer.Option(help="Database URL (default: KVFLOW_DATABASE_URL).")] = None,
) -> None:
    """Revert migrations down to REVISION."""
    from migrations import downgrade

    guarded("db downgrade", lambda: downgrade(revision, url=url))
    console.print(f"database at {revision}")


@db_app.command("current")
def db_current(
    url: Annotated[str | None, typer.Option(help="Database URL (default: KVFLOW_DATABASE_URL).")] = None,
) -> None:
    """Print the revision the database is at."""
    from migrations import current

    console.print(guarded("db current", lambda: asyncio.run(current(url=url))) or "(empty)")


@topics_app.command("ensure")
def topics_ensure() -> None:
    """Create kvflow's topics where missing (kv-events, node-stats, kv-events-dlq, kv-control)."""
    from confluent_kafka import KafkaException

    from eventbus.config import KafkaSettings
    from eventbus.kafka import ensure_topics, topic_specs

    settings = KafkaSettings()
    try:
        created = ensure_topics(settings)
    except (KafkaException, TimeoutError) as exc:
        _fail("topics ensure", f"Kafka at {settings.bootstrap}: {exc}")
    for spec in topic_specs(settings):
        state = "created" if spec.name in created else "exists"
        console.print(f"{spec.name}: {state} ({spec.partitions} partitions)")


schema_app = typer.Typer(no_args_is_help=True, help="The wire schema as JSON Schema.")
app.add_typer(schema_app, name="schema")


@schema_app.command("export")
def schema_export(
    out_dir: Annotated[str, typer.Option("--out", help="Folder to write *.schema.json into.")] = "docs/schema",
) -> None:
    """Write the JSON Schema of EventBatch, NodeStats and ControlCommand (eventbus.protocol)."""
    import json
    from pathlib import Path

    from eventbus.protocol import json_schemas

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        path = folder / f"{name}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        console.print(f"wrote {path}")


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: figures against a baseline measured in the same run.")
app.add_typer(bench_app, name="bench")

JsonOpt = Annotated[str | None, typer.Option("--json", help="Write the result as JSON to this file.")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="A small, fast version (for smoke tests).")]


def _run_bench(name: str, json_path: str | None, produce: Callable[[Callable[[str], None]], Any]) -> None:
    """Run a benchmark (``produce(say)`` returns its BenchResult), print it, and write it as JSON."""

    def run() -> None:
        with signals_stop():  # a stop signal ends the run's processes (their finally blocks)
            result = produce(lambda m: console.print(f"[dim]{m}[/]"))
        result.print(console)
        if json_path:
            result.write_json(json_path)
            console.print(f"wrote {json_path}")

    guarded(f"bench {name}", run)


@bench_app.command("kv")
def bench_kv_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                 repeats: Annotated[int, typer.Option(help="Interleaved rounds.")] = 5,
                 trace: Annotated[str | None, typer.Option(
                     "--trace", help="A trace in the Mooncake format (timestamp, input_length, output_length, "
                                     "hash_ids; JSON lines) to replay: default the conversation trace.")] = None,
                 out: Annotated[str, typer.Option(help="Folder for the hit-rate plot.")] = "artifacts",
                 robustness: Annotated[bool, typer.Option(
                     help="Also each family's second draw and the trace in thirds (about 40 s more).")] = True,
                 ) -> None:
    """KV core: cost per operation vs an OrderedDict LRU; hit rates of LRU, the adaptive policy, ARC,
    S3-FIFO and Belady on a trace and the generated families (and, reported, on their second draw
    and the trace in thirds); the adaptive policy's cost."""
    from kvflow.bench.kv import bench_kv

    kw: dict[str, Any] = {"num_blocks": 2_000, "requests": 1_500, "repeats": 2, "capacities": (400,),
                          "trace_limit": 1_500, "families": ("multi_turn", "scan"), "family_requests": 600} \
        if quick else {"repeats": repeats, "robustness": robustness}
    _run_bench("kv", json_path, lambda say: bench_kv(say=say, trace_path=trace, plot_dir=pathlib.Path(out), **kw))


@app.command("materializer")
def materializer_cmd(
    loglevel: Annotated[str, typer.Option(help="crit, error, warn, info or debug.")] = "info",
) -> None:
    """Run a materializer worker: kv-events and node-stats from Kafka into PostgreSQL (faust)."""
    from state_store.faust_app import build_app, run_worker

    def run() -> None:
        try:
            faust_app = build_app()
        except ValueError as exc:  # a refused setting (e.g. a placeholder secret in production)
            raise StackError(str(exc)) from exc
        run_worker(faust_app, loglevel)

    guarded("materializer", run)


events_app = typer.Typer(no_args_is_help=True, help="Kafka events, for people and other consumers.")
app.add_typer(events_app, name="events")


@events_app.command("tail")
def events_tail(
    group: Annotated[str | None, typer.Option(help="Consumer group (default: a new one).")] = None,
    from_beginning: Annotated[bool, typer.Option("--from-beginning", help="Start at the oldest event.")] = False,
    node: Annotated[str | None, typer.Option(help="Only this node's events.")] = None,
    limit: Annotated[int | None, typer.Option(help="Stop after this many events.")] = None,
    idle_timeout: Annotated[float | None, typer.Option(help="Stop after this many seconds without messages.")]
    = None,
) -> None:
    """Print kv-events live (its own consumer group), with summary counts every few seconds."""
    from eventbus.config import KafkaSettings
    from kvflow.tail import tail

    tail(KafkaSettings(), group=group, from_beginning=from_beginning, node=node, limit=limit,
         idle_timeout_s=idle_timeout, emit=lambda line: console.print(line, highlight=False, soft_wrap=True))


@bench_app.command("pipeline")
def bench_pipeline_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                       workers: Annotated[int, typer.Option(
                           "--workers", min=1, max=6,
                           help="Also a group of this many workers, in the same run (figures."
                                "events_per_s_2_workers, ratios.two_workers_vs_one for 2).")] = 1) -> None:
    """Block events/s from Kafka into PostgreSQL (one worker) vs raw COPY; freshness at 10k events/s."""
    from kvflow.bench.pipeline import bench_pipeline

    kw: dict[str, Any] = {"nodes": 2, "requests_per_node": 300, "freshness_s": 3.0, "rounds": 1} if quick else {}
    _run_bench("pipeline", json_path, lambda say: bench_pipeline(say=say, workers=workers, **kw))


@app.command("node")
def node_cmd(
    node_id: Annotated[str | None, typer.Option("--node-id", help="Stable node name (Kafka key).")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address.")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8101).")] = None,
    num_blocks: Annotated[int | None, typer.Option("--num-blocks", help="GPU-tier KV blocks.")] = None,
    host_blocks: Annotated[int | None, typer.Option("--host-blocks", help="Host-tier KV blocks.")] = None,
    block_size: Annotated[int | None, typer.Option("--block-size", help="Tokens per block.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or auto.")] = None,
    model_dir: Annotated[str | None, typer.Option("--model-dir", help="Local Hugging Face Llama folder.")] = None,
    model_preset: Annotated[str | None, typer.Option("--model-preset", help="tiny or small (random).")] = None,
    advertise_url: Annotated[str | None, typer.Option("--advertise-url", help="URL the router uses.")] = None,
    adaptive: Annotated[bool | None, typer.Option("--adaptive/--no-adaptive",
                                                  help="Learned priorities without hints.")] = None,
    kafka: Annotated[bool | None, typer.Option("--kafka/--no-kafka", help="Publish events to Kafka.")] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run one inference node: a torch model over the paged KV cache, its HTTP API, events to Kafka."""
    import logging

    import uvicorn

    from inference_node.node import NodeSettings, build_node
    from inference_node.server import create_app

    overrides: dict[str, Any] = {k: v for k, v in {
        "node_id": node_id, "host": host, "port": port, "num_blocks": num_blocks, "host_blocks": host_blocks,
        "block_size": block_size, "device": device, "model_dir": model_dir, "model_preset": model_preset,
        "advertise_url": advertise_url, "adaptive": adaptive, "kafka": kafka}.items() if v is not None}
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> None:
        from eventbus.config import Environment, KafkaSettings, RuntimeSettings

        try:
            settings = NodeSettings(**overrides)
            env = RuntimeSettings().env
            kafka_settings = KafkaSettings()
            kafka_settings.check(env)
            if not settings.api_keys:
                if env is Environment.PRODUCTION:
                    raise ValueError("KVFLOW_NODE_API_KEYS is required when KVFLOW_ENV=production")
                console.print("[yellow]development mode: no API keys, the node's API is open[/]")
            node = build_node(settings, kafka_settings)
        except (ValueError, FileNotFoundError) as exc:
            raise StackError(str(exc)) from exc
        console.print(f"node {settings.node_id} (instance {node.instance_id}) listening on "
                      f"http://{settings.host}:{settings.port} — {node.model.cfg.name} on {node.device}, "
                      f"{settings.num_blocks}+{settings.host_blocks} blocks of {settings.block_size} tokens",
                      highlight=False)
        try:
            # NOTE: after its graceful shutdown uvicorn (0.54) raises the signal that stopped it again,
            # with the handler it found: Python's default for SIGTERM would end the process before
            # node.close() (the last events, the goodbye heartbeat). signals_stop's handler raises
            # instead, which uvicorn.run swallows, and the node closes.
            with signals_stop():
                uvicorn.run(create_app(node), host=settings.host, port=settings.port, log_level=log_level.lower(),
                            access_log=False)
        finally:
            node.close()

    guarded("node", run)


@app.command("bridge")
def bridge_cmd(
    engine: Annotated[str, typer.Argument(help="vllm, sglang or trtllm.")],
    node_id: Annotated[str | None, typer.Option("--node-id", help="The node's name in kvflow (Kafka key).")] = None,
    events: Annotated[str | None, typer.Option("--events", help="The engine's ZMQ PUB endpoint (vllm, sglang), "
                                                                "e.g. tcp://127.0.0.1:5557.")] = None,
    replay: Annotated[str | None, typer.Option("--replay", help="Its replay endpoint, e.g. "
                                                                "tcp://127.0.0.1:5558.")] = None,
    engine_url: Annotated[str | None, typer.Option("--engine-url", help="The engine's OpenAI server.")] = None,
    metrics_url: Annotated[str | None, typer.Option("--metrics-url", help="Its Prometheus page.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="The model (default: /v1/models).")] = None,
    block_size: Annotated[int | None, typer.Option("--block-size", help="Tokens per block.")] = None,
    num_blocks: Annotated[int | None, typer.Option("--num-blocks", help="GPU blocks (default: metrics).")] = None,
    reset_engine_cache: Annotated[bool | None, typer.Option(
        "--reset-engine-cache/--no-reset-engine-cache",
        help="Empty the engine's prefix cache when kvflow's view of it is partial.")] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Publish a real engine's KV events and load to kvflow, as a node (docs/bridges.md)."""
    import logging

    from bridge.main import build, run
    from bridge.service import BridgeSettings

    overrides: dict[str, Any] = {k: v for k, v in {
        "engine": engine, "node_id": node_id, "events": events, "replay": replay, "engine_url": engine_url,
        "metrics_url": metrics_url, "model": model, "block_size": block_size, "num_blocks": num_blocks,
        "reset_engine_cache": reset_engine_cache}.items() if v is not None}
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per scrape

    def go() -> None:
        from pydantic import ValidationError

        from eventbus.config import KafkaSettings, RuntimeSettings

        try:
            settings = BridgeSettings(**overrides)
            kafka_settings = KafkaSettings()
            kafka_settings.check(RuntimeSettings().env)
            bridge = build(settings, kafka_settings)
        except (ValueError, ValidationError) as exc:
            raise StackError(str(exc)) from exc
        console.print(f"bridge {settings.node_id}: {settings.engine} at {settings.engine_url}"
                      f"{f', events {settings.events}' if settings.events else ''} (instance {bridge.instance_id})",
                      highlight=False)
        with signals_stop(), contextlib.suppress(Stopped):  # a stop signal: run's finally says goodbye
            run(bridge)

    guarded("bridge", go)


@bench_app.command("bridge")
def bench_bridge_cmd(json_path: JsonOpt = None, quick: QuickOpt = False) -> None:
    """Blocks/s one bridge translates from a vLLM publisher into Kafka, next to the publisher's own rate."""
    from kvflow.bench.bridge import bench_bridge

    kw: dict[str, Any] = {"batches": 60, "repeats": 1, "rate_run_s": 1.5} if quick else {}
    _run_bench("bridge", json_path, lambda say: bench_bridge(say=say, **kw))


@bench_app.command("node")
def bench_node_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                   device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "auto") -> None:
    """Prefill of a long prompt 90% cached vs cold, prefill and decode tokens/s."""
    from kvflow.bench.node import bench_node

    kw: dict[str, Any] = {"preset": "tiny", "prompt_tokens": 512, "repeats": 2, "decode_steps": 8} if quick else {}
    _run_bench("node", json_path, lambda say: bench_node(device=device, say=say, **kw))


@app.command("router")
def router_cmd(
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    workers: Annotated[int | None, typer.Option(help="Router processes on the port (default 1).")] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run the routing API: KV-aware decisions over PostgreSQL, a proxy to the nodes, a dashboard."""
    import logging

    import uvicorn

    from routing_api.app import create_app
    from routing_api.config import RouterSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> None:
        given = {"host": host, "port": port, "workers": workers}
        overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        try:
            settings = RouterSettings(**overrides)
            app_ = create_app(settings)  # refuses a bad configuration here, before any worker starts
        except ValueError as exc:
            raise StackError(str(exc)) from exc
        console.print(f"router listening on http://{settings.host}:{settings.port} "
                      f"(dashboard: http://{settings.host}:{settings.port}/dashboard)"
                      + (f", {settings.workers} processes" if settings.workers > 1 else ""), highlight=False)
        if settings.workers == 1:
            uvicorn.run(app_, host=settings.host, port=settings.port, log_level=log_level.lower(), access_log=False)
        else:  # each worker process builds its app from the same environment
            from kvflow.supervise import run_router_workers

            run_router_workers(uvicorn.Config("kvflow.supervise:router_worker_app", factory=True,
                                              workers=settings.workers, host=settings.host, port=settings.port,
                                              log_level=log_level.lower(), access_log=False))

    guarded("router", run)


@bench_app.command("route")
def bench_route_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                    fleet: Annotated[int | None, typer.Option(
                        "--fleet", min=32,
                        help="Instead: the decision's p50/p99 as node_blocks grows, 32 x 50k, N x 50k and "
                             "N x 200k blocks in one run (N=128: 1.6M, 6.4M, 25.6M rows; --quick: blocks / 50), "
                             "figures.p50_ms_by_rows.")] = None) -> None:
    """Routing decisions through the HTTP API (32 nodes x 50k blocks) vs the bare SQL query."""
    if fleet is not None:
        from kvflow.bench.fleet import bench_fleet

        fkw: dict[str, Any] = {"requests": 200, "prompts": 16} if quick else {}
        _run_bench("route", json_path, lambda say: bench_fleet(top_nodes=fleet, quick=quick, say=say, **fkw))
        return
    from kvflow.bench.route import bench_route

    kw: dict[str, Any] = {"nodes": 4, "blocks_per_node": 2000, "prompts": 16, "requests": 200} if quick else {}
    _run_bench("route", json_path, lambda say: bench_route(say=say, **kw))


@app.command("demo")
def demo_cmd(
    requests: Annotated[int, typer.Option(help="Requests to send through the router.")] = 90,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the services running after the summary.")] = False,
    external: Annotated[bool, typer.Option("--external", help="Use the Kafka and PostgreSQL named by "
                                           "KVFLOW_KAFKA_BOOTSTRAP / KVFLOW_DATABASE_URL (e.g. the compose "
                                           "stack) instead of starting the local stack.")] = False,
) -> None:
    """The main job: stack, materializer, router, two CPU nodes, a realistic workload, a summary."""
    from kvflow.demo import run_demo

    code = guarded("demo", lambda: run_demo(console, requests=requests, keep=keep, use_local_stack=not external))
    raise typer.Exit(code)


@app.command("sim")
def sim_cmd(
    json_path: JsonOpt = None,
    quick: QuickOpt = False,
    trace: Annotated[str | None, typer.Option(help="A trace in the Mooncake format (default: the conversation "
                                              "trace in ../shared/traces or data/traces).")] = None,
    out: Annotated[str, typer.Option(help="Folder for the report and the plots.")] = "artifacts/sim",
) -> None:
    """Trace-driven cluster simulator: eviction and routing policies on the real KV core."""
    from pathlib import Path

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvflow.sim.run import run_sim

    def run() -> None:
        kw: dict[str, Any] = {"capacities": (200, 400), "reference": 400, "curve_capacities": (200, 800),
                              "generator_requests": 800, "limit": 1500} if quick else {}
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("simulating …", total=None)
            result = run_sim(trace=trace, out_dir=Path(out), step=lambda m: progress.update(task, description=m),
                             **kw)
        result.print(console)
        console.print(f"report: {result.details['report']}; plots in {out}")
        if json_path:
            result.write_json(json_path)
            console.print(f"wrote {json_path}")

    guarded("sim", run)


trace_app = typer.Typer(no_args_is_help=True, help="Request traces in the Mooncake format (docs/traces.md).")
app.add_typer(trace_app, name="trace")


@trace_app.command("export")
def trace_export_cmd(
    out: Annotated[str, typer.Option("--out", help="The trace file to write (Mooncake JSON lines).")],
    node: Annotated[str | None, typer.Option("--node", help="Only this node's history.")] = None,
    since: Annotated[str | None, typer.Option(help="Requests from this time on (ISO 8601; UTC without a zone).")]
    = None,
    until: Annotated[str | None, typer.Option(help="Events before this time (ISO 8601; UTC without a zone).")]
    = None,
    database_url: Annotated[str | None, typer.Option(
        "--database-url", help="PostgreSQL URL (default: KVFLOW_DATABASE_READER_URL, the read-only role).")] = None,
) -> None:
    """Write the fleet's history (block_events) as a request trace: one request per stored event."""
    import asyncpg

    from kvflow.trace_export import export_trace, parse_time
    from state_store.config import DatabaseSettings

    try:
        start, end = (parse_time(since) if since else None), (parse_time(until) if until else None)
    except ValueError as exc:
        _fail("trace export", f"not an ISO 8601 time: {exc}")
    url = database_url or DatabaseSettings().reader()

    def run() -> Any:
        try:
            return asyncio.run(export_trace(url, out, node=node, since=start, until=end))
        except asyncpg.PostgresError as exc:
            raise StackError(f"{type(exc).__name__}: {_first_line(exc)} (at {redact_url(url)})") from exc

    stats = guarded("trace export", run)
    console.print(f"wrote {out}: {stats.requests} requests from {stats.stored_events} stored events "
                  f"({stats.decode_continuations} decode continuations, {stats.partial_chains} with an unknown "
                  f"ancestor, {stats.before_since} before --since)", highlight=False, soft_wrap=True)


def main() -> None:
    # Started by a kvflow supervisor (demo, benches, `router --workers`): leave when it is gone.
    follow_parent()
    try:
        app()
    except Stopped as exc:
        sys.exit(128 + exc.signum)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
