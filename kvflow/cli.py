"""The ``kvflow`` command line.

Every sub-command is a thin shell over a library function: it parses flags, calls, and prints.
Errors the user can fix are printed in one line (``kvflow <cmd>: …``) with exit status 1.

This module holds the app, the services (``materializer``, ``node``, ``bridge``, ``router``,
``demo``) and the operations (``stack``, ``db``, ``topics``, ``schema``, ``events``);
:mod:`kvflow.cli_bench` the benchmarks, the simulator and traces; :mod:`kvflow.cli_common` what
they share. Each command imports its packages inside its function, so that one service's install
(``pip install 'kvflow[router]'``) runs its command, and a command whose extra is missing says
which (:func:`~kvflow.cli_common.needs_extra`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvflow.cli_bench import bench_app, sim_cmd, trace_app
from kvflow.cli_common import console, fail, guarded, needs_extra
from kvflow.cli_model import model_app, pull_model
from kvflow.stack import ServiceStatus, Stack, StackError, StackSettings, redact_url
from kvflow.supervise import Stopped, follow_parent, signals_stop

app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="kvflow: see and use the KV cache of an LLM inference fleet.",
)
stack_app = typer.Typer(no_args_is_help=True, help="The local development stack (Kafka + PostgreSQL).")
db_app = typer.Typer(no_args_is_help=True, help="Database schema migrations (Alembic).")
topics_app = typer.Typer(no_args_is_help=True, help="Kafka topics of kvflow.")
schema_app = typer.Typer(no_args_is_help=True, help="The wire schema as JSON Schema.")
events_app = typer.Typer(no_args_is_help=True, help="Kafka events, for people and other consumers.")
# The groups in the order of `kvflow --help` (after the commands, in the order they are defined below).
app.add_typer(stack_app, name="stack")
app.add_typer(db_app, name="db")
app.add_typer(topics_app, name="topics")
app.add_typer(schema_app, name="schema")
app.add_typer(bench_app, name="bench")
app.add_typer(events_app, name="events")
app.add_typer(trace_app, name="trace")
app.add_typer(model_app, name="model")


@stack_app.command("up")
@needs_extra("stack", "stack up")
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
    stack = guarded("stack up", lambda: Stack(settings))

    def up() -> dict[str, str]:
        with signals_stop():  # a stop signal ends its helper commands (subprocess.run kills them)
            return stack.up(say=lambda m: console.print(f"[dim]{m}[/]"))

    result = guarded("stack up", up)
    for name, state in result.items():
        console.print(f"[green]{name}[/]: {state}")
    _print_status(stack)


@stack_app.command("down")
@needs_extra("stack", "stack down")
def stack_down() -> None:
    """Stop exactly what `kvflow stack up` started."""
    stack = guarded("stack down", Stack)
    result = guarded("stack down", stack.down)
    for name, state in result.items():
        console.print(f"{name}: {state}")


@stack_app.command("status")
@needs_extra("stack", "stack status")
def stack_status(
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless every service runs.")] = False,
) -> None:
    """Say what runs where."""
    stack = guarded("stack status", Stack)
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
@needs_extra("db", "db upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    url: Annotated[str | None, typer.Option(help="Database URL (default: KVFLOW_DATABASE_URL).")] = None,
) -> None:
    """Apply migrations up to REVISION (default: head)."""
    from migrations import upgrade

    guarded("db upgrade", lambda: upgrade(revision, url=url))
    console.print(f"database at {revision}")


@db_app.command("downgrade")
@needs_extra("db", "db downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision, e.g. -1 or base.")],
    url: Annotated[str | None, typer.Option(help="Database URL (default: KVFLOW_DATABASE_URL).")] = None,
) -> None:
    """Revert migrations down to REVISION."""
    from migrations import downgrade

    guarded("db downgrade", lambda: downgrade(revision, url=url))
    console.print(f"database at {revision}")


@db_app.command("current")
@needs_extra("db", "db current")
def db_current(
    url: Annotated[str | None, typer.Option(help="Database URL (default: KVFLOW_DATABASE_URL).")] = None,
) -> None:
    """Print the revision the database is at."""
    from migrations import current

    console.print(guarded("db current", lambda: asyncio.run(current(url=url))) or "(empty)")


@topics_app.command("ensure")
@needs_extra("kafka", "topics ensure")
def topics_ensure() -> None:
    """Create kvflow's topics where missing (kv-events, node-stats, kv-events-dlq, kv-control)."""
    from confluent_kafka import KafkaException

    from eventbus.config import KafkaSettings
    from eventbus.kafka import ensure_topics, topic_specs

    settings = KafkaSettings()
    try:
        created = ensure_topics(settings)
    except (KafkaException, TimeoutError) as exc:
        fail("topics ensure", f"Kafka at {settings.bootstrap}: {exc}")
    for spec in topic_specs(settings):
        state = "created" if spec.name in created else "exists"
        console.print(f"{spec.name}: {state} ({spec.partitions} partitions)")


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


@app.command("materializer")
@needs_extra("materializer", "materializer")
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


@events_app.command("tail")
@needs_extra("kafka", "events tail")
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


@app.command("node")
@needs_extra("node", "node")
def node_cmd(
    node_id: Annotated[str | None, typer.Option("--node-id", help="Stable node name (Kafka key).")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address.")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8101).")] = None,
    num_blocks: Annotated[int | None, typer.Option("--num-blocks", help="GPU-tier KV blocks.")] = None,
    host_blocks: Annotated[int | None, typer.Option("--host-blocks", help="Host-tier KV blocks.")] = None,
    block_size: Annotated[int | None, typer.Option("--block-size", help="Tokens per block.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or auto.")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto (float32 on the CPU, bfloat16 on CUDA), float32, "
                                                   "bfloat16 or float16.")] = None,
    model_dir: Annotated[str | None, typer.Option("--model-dir", help="Local Hugging Face Llama folder.")] = None,
    model_preset: Annotated[str | None, typer.Option("--model-preset", help="tiny or small (random).")] = None,
    advertise_url: Annotated[str | None, typer.Option("--advertise-url", help="URL the router uses.")] = None,
    adaptive: Annotated[bool | None, typer.Option("--adaptive/--no-adaptive",
                                                  help="Learned priorities without hints.")] = None,
    kafka: Annotated[bool | None, typer.Option("--kafka/--no-kafka", help="Publish events to Kafka.")] = None,
    max_batch_tokens: Annotated[int | None, typer.Option("--max-batch-tokens",
                                                         help="New tokens in one forward at most.")] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run one inference node: a torch model over the paged KV cache, its HTTP API, events to Kafka."""
    import logging

    import uvicorn

    from inference_node.node import NodeSettings, build_node
    from inference_node.server import create_app

    overrides: dict[str, Any] = {k: v for k, v in {
        "node_id": node_id, "host": host, "port": port, "num_blocks": num_blocks, "host_blocks": host_blocks,
        "block_size": block_size, "device": device, "dtype": dtype, "model_dir": model_dir,
        "model_preset": model_preset,
        "advertise_url": advertise_url, "adaptive": adaptive, "kafka": kafka,
        "max_batch_tokens": max_batch_tokens}.items() if v is not None}
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
@needs_extra("bridge", "bridge")
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
    vllm_plugin: Annotated[bool | None, typer.Option(
        "--vllm-plugin/--no-vllm-plugin",
        help="vLLM runs kvflow's retention plugin: the router sends it retention from the first request "
             "(else from the first event carrying priorities).")] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Publish a real engine's KV events and load to kvflow, as a node (docs/bridges.md)."""
    import logging

    from bridge.main import build, run
    from bridge.service import BridgeSettings

    overrides: dict[str, Any] = {k: v for k, v in {
        "engine": engine, "node_id": node_id, "events": events, "replay": replay, "engine_url": engine_url,
        "metrics_url": metrics_url, "model": model, "block_size": block_size, "num_blocks": num_blocks,
        "reset_engine_cache": reset_engine_cache, "vllm_plugin": vllm_plugin}.items() if v is not None}
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


@app.command("router")
@needs_extra("router", "router")
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


@app.command("demo")
@needs_extra("all", "demo", probe=("torch", "faust", "uvicorn", "alembic", "confluent_kafka"))
def demo_cmd(
    requests: Annotated[int | None, typer.Option(help="Requests to send through the router (default 90; 24 with "
                                                      "--model).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Serve a real model: a name kvflow model list shows (pulled once, e.g. smollm2-135m), or a "
                        "Hugging Face folder. Default: random weights (answers are noise).")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the services running after the summary.")] = False,
    external: Annotated[bool, typer.Option("--external", help="Use the Kafka and PostgreSQL named by "
                                           "KVFLOW_KAFKA_BOOTSTRAP / KVFLOW_DATABASE_URL (e.g. the compose "
                                           "stack) instead of starting the local stack.")] = False,
) -> None:
    """The main job: stack, materializer, router, two CPU nodes, a realistic workload, a summary."""
    from kvflow.demo import run_demo

    model_dir = None
    if model is not None:
        model_dir = Path(model) if Path(model).is_dir() else pull_model(model)
    n = requests if requests is not None else 24 if model_dir is not None else 90
    code = guarded("demo", lambda: run_demo(console, requests=n, keep=keep, use_local_stack=not external,
                                            model_dir=model_dir))
    raise typer.Exit(code)


app.command("sim")(sim_cmd)  # after demo, as `kvflow --help` lists it


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
