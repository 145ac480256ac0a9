"""Smoke tests of the benchmarks: each runs end to end (``--quick``) and writes the JSON it promises.

Figures are not asserted — speed belongs to the benchmarks, not to tests on noisy machines —
but every named figure, baseline and ratio must be there and be a finite, positive number.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from inference_node.kv.shadows import native_available
from tests.support import ROOT

NAMED = {
    # --quick replays the trace at 400 blocks, not 1,000 / 4,000 / 16,000: the per-capacity names differ
    "kv": ["ratios.cost_vs_lru", "ratios.adaptive_vs_lru_hit_rate_min", "ratios.adaptive_vs_lru_hit_rate_400",
           "ratios.adaptive_vs_belady_hit_rate_400", "ratios.adaptive_vs_arc_hit_rate_min",
           "baseline.arc_hit_rate_400", "baseline.s3fifo_hit_rate_400",
           "ratios.adaptive_vs_arc_where_arc_gains_min", "ratios.adaptive_floor_cost",
           "ratios.adaptive_strict_guard_cost"],
    "model": ["ratios.prefill_speedup_cached_90pct", "figures.prefill_tokens_per_s", "figures.decode_tokens_per_s"],
    # --quick: the node alone on SmolLM2 (no vLLM), float32, concurrency 1 and 4
    "node": ["figures.kvflow_float32_tokens_per_s_c1", "figures.kvflow_float32_tokens_per_s_c4",
             "figures.kvflow_float32_ttft_cached_p50_ms", "figures.kvflow_float32_ttft_cold_p50_ms",
             "figures.kvflow_float32_peak_rss_mb", "figures.kvflow_float32_pressure_cached_share"],
    # --quick: every variant once, its own fresh node; the quick flood evicts every unmarked system
    # prompt (no ratio of cached shares: against 0), the marked ones stay
    "prompt-cache": [f"{section}.{v}_{figure}" for v in ("breakpoint", "implicit", "cache_control")
                     for section, figure in (("figures", "cached_share"), ("figures", "system_cached_share"),
                                             ("figures", "ttft_p99_ms"), ("ratios", "ttft_p99_vs_none"))]
                    + ["baseline.none_ttft_p50_ms", "baseline.none_ttft_p99_ms"],
    "pipeline": ["figures.events_per_s", "baseline.raw_events_per_s", "ratios.vs_raw_ceiling",
                 "figures.freshness_p50_ms", "figures.freshness_p99_ms",
                 # --workers 2 (as the smoke test runs it): a group of two workers in the same run
                 "figures.events_per_s_2_workers", "ratios.two_workers_vs_one"],
    # bench route --fleet: the decision as node_blocks grows (--quick: 32 x 1k, 128 x 1k, 128 x 4k)
    "fleet": ["figures.p50_ms_smallest", "figures.p50_ms_largest", "ratios.p50_growth", "ratios.rows_growth"],
    "route": ["figures.p50_ms", "figures.p99_ms", "figures.decisions_per_s", "baseline.sql_p50_ms",
              "figures.multi_turn_cached_share", "baseline.multi_turn_cached_share",
              # a real subword tokenizer (a BPE trained by the bench; --quick: 8,192 ids)
              "figures.bpe_p50_ms", "figures.bpe_p99_ms", "figures.bpe_cold_p50_ms",
              "figures.bpe_tokenizers_alone_p50_ms", "figures.bpe_tokenize_share", "figures.bpe_tokenize_share_cold",
              "figures.bpe_uncached_p50_ms", "figures.bpe_vocab_size"],
    "bridge": ["figures.bridge_blocks_per_s", "figures.bridge_core_share_at_10k", "baseline.publisher_blocks_per_s",
               "ratios.bridge_vs_publisher"],
}


#: The options each smoke test adds to `bench NAME --quick` ("fleet" is `bench route --fleet 128`).
ARGS = {"pipeline": ["--workers", "2"], "fleet": ["--fleet", "128"]}


def run_bench(name: str, tmp_path, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / f"{name}.json"
    command = "route" if name == "fleet" else name
    proc = subprocess.run([sys.executable, "-m", "kvflow.cli", "bench", command, "--quick", *ARGS.get(name, []),
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == command and result["environment"]["cpus"] >= 1
    for path in NAMED[name]:
        section, key = path.split(".")
        value = result[section][key]
        assert isinstance(value, float | int) and math.isfinite(value) and value > 0, (path, value)
    return result


@pytest.mark.parametrize("name", ["kv", "model"])
def test_benchmarks_without_services(name, tmp_path):
    result = run_bench(name, tmp_path)
    if name == "kv":  # the floor on the adversarial traps: every window within the argued bound
        traps = {f"{t}_{c}" for t in ("junk_trap", "frequency_trap") for c in (100, 250)}
        assert set(result["details"]["floor"]) == traps
        assert result["ratios"]["floor_bound_excess_max"] <= 0


@pytest.mark.integration
def test_the_node_benchmark_serves_the_real_model(tmp_path, smollm2_dir):
    """``bench node --quick``: the node as a server on SmolLM2 (pulled), every scenario once."""
    result = run_bench("node", tmp_path)
    assert result["details"]["model"] == "SmolLM2-135M-Instruct" and "vllm" not in result["details"]
    rounds = result["details"]["per_round"]["kvflow_float32"]
    assert len(rounds["scenarios"]) == len(rounds["pressure"]) == result["details"]["rounds"] == 1
    # The quick workload's retained system prompts stay cached through their floods.
    assert result["figures"]["kvflow_float32_pressure_cached_share"] > 0.9


@pytest.mark.integration
def test_the_prompt_cache_benchmark_marks_system_prompts_on_the_real_model(tmp_path, smollm2_dir):
    """``bench prompt-cache --quick``: each variant on a fresh node of SmolLM2 (pulled), the marks
    applied where the system message ends."""
    result = run_bench("prompt-cache", tmp_path)
    details = result["details"]
    assert details["model"] == "SmolLM2-135M-Instruct" and details["rounds"] == 1
    assert details["orders"] == [["none", "breakpoint", "implicit", "cache_control"]]
    assert {name: len(rounds) for name, rounds in details["per_round"].items()} == {
        "none": 1, "breakpoint": 1, "implicit": 1, "cache_control": 1}
    for desk, end in details["system_prompt_tokens"].items():
        assert details["marks"]["none"][desk]["retained_tokens"] == [0]
        for name in ("breakpoint", "implicit", "cache_control"):
            marks = details["marks"][name]
            # every breakpoint at the system message's end as the template renders it; whole blocks retained
            assert marks["breakpoints_elsewhere"] == [] and marks[desk]["breakpoints"]
            assert marks[desk]["retained_tokens"] == [end // 32 * 32], (name, desk, marks[desk])
    kinds = {name: {k for desk in ("system-A", "system-B") for k, _ in details["marks"][name][desk]["breakpoints"]}
             for name in ("breakpoint", "implicit", "cache_control")}
    # (implicit mode: the implicit breakpoint falls on the explicit one's token, so it is not listed again)
    assert kinds == {"breakpoint": {"prompt_cache_breakpoint"}, "implicit": {"implicit"},
                     "cache_control": {"cache_control"}}
    # each for its lifetime: cache_control's 1h covers the implicit breakpoint's default 30 minutes
    assert {name: details["marks"][name]["system-A"]["durations_s"] for name in kinds} == {
        "breakpoint": [1800.0], "implicit": [1800.0], "cache_control": [3600.0]}
    # The flood evicts the unmarked system prompts and not the marked ones.
    assert result["baseline"]["none_system_cached_share"] == 0
    assert all(result["figures"][f"{name}_system_cached_share"] > 0.5 for name in kinds)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["pipeline", "route", "bridge", "fleet"])
def test_benchmarks_against_the_stack(name, tmp_path, kafka_settings, migrated_database_url):
    # The benchmark makes its own topics and scratch databases on the stack the fixtures checked.
    result = run_bench(name, tmp_path, {**os.environ, "KVFLOW_KAFKA_BOOTSTRAP": kafka_settings.bootstrap})
    if name == "pipeline":
        assert result["details"]["throughput_seconds"]["n"] == result["details"]["rounds"] == 1
        assert result["details"]["throughput_seconds_2_workers"]["n"] == 1
    if name == "fleet":  # three fleets, each table larger, the same decisions
        steps = result["details"]["steps"]
        assert [(s["nodes"], s["blocks_per_node"]) for s in steps] == [(32, 1000), (128, 1000), (128, 4000)]
        assert steps[0]["rows"] < steps[1]["rows"] < steps[2]["rows"]
        assert set(result["figures"]["p50_ms_by_rows"]) == {str(s["rows"]) for s in steps}
    if name == "bridge" and os.environ.get("KVFLOW_REQUIRE_ENGINES") == "1":  # make test: vLLM's own publisher
        assert result["details"]["publisher"] == "vllm.distributed.kv_events.ZmqEventPublisher"
    if name == "route":  # every multi-turn prompt after the first turn reused its history
        cache = result["details"]["bpe"]["prefix_cache"]
        assert cache["hits"] >= result["details"]["bpe"]["multi_turn_prompts"] and cache["uncacheable"] == 0


def test_bench_kv_replays_a_trace_given_by_the_user(tmp_path):
    trace = tmp_path / "mine.jsonl"
    lines = []
    for i in range(300):  # conversations of 3 turns over a shared 4-block system prompt
        conv, turn = divmod(i, 3)
        ids = [0, 1, 2, 3] + [1000 + conv * 10 + t for t in range(turn + 1)]
        lines.append(json.dumps({"timestamp": i * 100, "input_length": 512 * len(ids), "output_length": 100,
                                 "hash_ids": ids}))
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "kv.json"
    proc = subprocess.run([sys.executable, "-m", "kvflow.cli", "bench", "kv", "--quick", "--trace", str(trace),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["details"]["trace"] == str(trace) and result["details"]["trace_requests"] == 300
    assert 0 < result["baseline"]["lru_hit_rate_400"] <= result["baseline"]["belady_hit_rate_400"] <= 1
    # More traffic, reported: the families' second draw and the user's trace in thirds.
    robust = result["details"]["robustness"]
    assert set(robust) == {"multi_turn_second_draw", "scan_second_draw", "trace_third_1", "trace_third_2",
                           "trace_third_3"}
    worst = min(a / b if b else 1.0 for row in robust.values()
                for a, b in zip(row["adaptive"], row["lru"], strict=True))
    assert result["ratios"]["robustness_adaptive_vs_lru_hit_rate_min"] == pytest.approx(worst)
    # The cost: a warm-up, then as many interleaved rounds as --quick's repeats (2), each round's ratio kept.
    rounds = result["details"]["cost_round_ratios"]
    assert len(rounds) == 2 and all(r > 0 for r in rounds)
    assert min(rounds) <= result["ratios"]["adaptive_cost_vs_priority"] <= max(rounds)
    # ... with the tables as installed; with the extension, the Python tables' cost beside it.
    assert result["details"]["adaptive_tables"] == ("compiled" if native_available() else "python")
    assert ("adaptive_python_cost_vs_priority" in result["ratios"]) == native_available()


def test_an_engine_stopped_while_it_starts_leaves_nothing_behind(tmp_path, monkeypatch):
    """A stop signal while a benchmark waits for an engine (vLLM's start takes minutes) stops the
    engine's whole session before the benchmark exits: it is not in the benchmark's list of
    started engines yet, so nothing else would."""
    from kvflow.bench import serving
    from kvflow.supervise import Stopped

    proc = serving._spawn([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "engine.log",
                          dict(os.environ))
    engine = serving.Engine("vllm", "float32", "http://127.0.0.1:9", "m", proc, tmp_path / "engine.log")

    def signalled(*_a: object, **_k: object) -> None:  # the signal arrives while it polls the engine
        raise Stopped(15)

    monkeypatch.setattr(serving.httpx, "get", signalled)
    with pytest.raises(Stopped):
        serving._ready(engine, timeout_s=30)
    assert proc.poll() is not None
    assert engine.pids() == []
