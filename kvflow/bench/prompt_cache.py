"""``kvflow bench prompt-cache``: clients' prompt-caching marks under a flood of one-off requests.

A chat workload on kvflow's node (SmolLM2-135M-Instruct, ``kvflow model pull smollm2-135m``; fp32,
blocks of 32, a KV capacity that holds the two system prompts and a few chats but not a flood):
requests under one of two system prompts ("desks" A and B, in turn), between each two a burst of
one-off chats (their own system prompts, shared with nothing) of a seeded size (default 1, 1, 2 or 5
requests, equally likely: the small bursts leave an unmarked system prompt in an LRU cache, the large
ones evict everything unretained). Every request is a streamed chat, greedy, ``max_tokens`` tokens,
one at a time.

The same requests run in each **variant**; only the system-prompt requests differ (the flood never
carries a mark), each variant a :class:`Variant` (a name and a function from a system-prompt chat
to its messages and extra body fields):

* ``none``: no marks (the baseline: the node's LRU alone);
* ``breakpoint``: the system message as a text part with OpenAI's ``prompt_cache_breakpoint``
  (``{"mode": "explicit", "ttl": "30m"}``);
* ``implicit``: no mark, only ``prompt_cache_options: {"mode": "implicit"}`` (kvflow places the
  breakpoint at the end of the system message);
* ``cache_control``: Anthropic's ``cache_control: {"type": "ephemeral", "ttl": "1h"}`` on the
  system message's text part.

Each variant runs on a node of its own, fresh in every round (retained blocks of one variant must
neither help nor hurt another): a round starts one node per variant at once (their starts overlap;
an idle node costs nothing), runs the variants one after another, a warm-up request first on each,
and stops them; the order of the variants turns by one every round, so a machine that drifts weighs
on all alike.

Figures per variant: the share of *all* prompt tokens served from cache (``cached_share``), the
system-prompt requests' own share (``system_cached_share``) and their TTFT p50/p99 (each system
prompt's first request, cold in every variant, left out). Shares are medians over rounds, TTFT
percentiles over the pooled requests of all rounds; ``details.per_round`` holds every round.
``none`` is the baseline; the ratios are each marked variant's against it:
``VARIANT_cached_share_vs_none`` (goal ≥ 1.2) and ``VARIANT_ttft_p99_vs_none`` (goal ≤ 0.7).

The run checks that the marks were applied: every marked request's answer must report (its first
streamed chunk's ``kvflow.prompt_cache``) retained tokens, and no other answer may report any;
the breakpoints' positions, the retained tokens and their lifetimes are in ``details.marks``,
beside where the system message ends as the chat template renders it (``system_prompt_tokens``).
"""

from __future__ import annotations

import asyncio
import copy
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.bench.engines import TOPICS, _chat, _system
from kvflow.bench.harness import BenchResult, percentile_ms
from kvflow.bench.serving import Answer, Engine, run_all, start_nodes
from kvflow.supervise import stop_groups

BLOCK_SIZE = 32
BASELINE = "none"

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Variant:
    """One way the system-prompt requests are sent: ``mark`` turns such a chat's messages (a copy,
    free to change) into the messages sent and the body's extra fields."""

    name: str
    mark: Callable[[Messages], tuple[Messages, dict[str, Any]]]
    #: whether each marked answer must report retained tokens (``kvflow.prompt_cache``)
    reports: bool = True


def _as_part(messages: Messages, **mark: Any) -> Messages:
    """The system message's content as one text part carrying ``mark``."""
    system = messages[0]
    system["content"] = [{"type": "text", "text": system["content"], **mark}]
    return messages


def _none(messages: Messages) -> tuple[Messages, dict[str, Any]]:
    return messages, {}


def _breakpoint(messages: Messages) -> tuple[Messages, dict[str, Any]]:
    return _as_part(messages, prompt_cache_breakpoint={"mode": "explicit", "ttl": "30m"}), {}


def _implicit(messages: Messages) -> tuple[Messages, dict[str, Any]]:
    return messages, {"prompt_cache_options": {"mode": "implicit"}}


def _cache_control(messages: Messages) -> tuple[Messages, dict[str, Any]]:
    return _as_part(messages, cache_control={"type": "ephemeral", "ttl": "1h"}), {}


VARIANTS: tuple[Variant, ...] = (Variant(BASELINE, _none, reports=False), Variant("breakpoint", _breakpoint),
                                 Variant("implicit", _implicit), Variant("cache_control", _cache_control))


class Workload:
    """The requests, the same for every variant (seeded): ``system_requests`` chats under desk A's
    and B's system prompts in turn, between each two a burst of one-off chats of a size drawn from
    ``bursts``."""

    def __init__(self, *, system_requests: int = 10, rules: int = 20, bursts: Sequence[int] = (1, 1, 2, 5),
                 seed: int = 11) -> None:
        rng = random.Random(seed)
        self.systems = [_system(rng, rules, f"Desk {d}. ") for d in ("A", "B")]
        self.requests: list[tuple[str, Messages]] = []
        self.bursts: list[int] = []
        for r in range(system_requests):
            self.requests.append((f"system-{'AB'[r % 2]}",
                                  _chat(self.systems[r % 2], f"Question {r}: may I bring {TOPICS[r % len(TOPICS)]}?")))
            if r == system_requests - 1:
                break
            self.bursts.append(rng.choice(list(bursts)))
            for f in range(self.bursts[-1]):
                self.requests.append(("flood", _chat(_system(rng, rules, f"One-off {r}.{f} #{rng.randrange(10**9)}. "),
                                                     "Summarize.")))
        self.warmup = _chat(_system(rng, rules, f"Warm-up #{rng.randrange(10**9)}. "), "Hello?")


def _run(engine: Engine, w: Workload, variant: Variant, max_tokens: int) -> dict[str, Any]:
    """The workload once on a fresh node, the system-prompt requests sent as ``variant`` says."""
    asyncio.run(run_all(engine, [(w.warmup, {})], max_tokens, 1))
    requests = [variant.mark(copy.deepcopy(m)) if kind != "flood" else (m, {}) for kind, m in w.requests]
    answers, wall = asyncio.run(run_all(engine, requests, max_tokens, 1))
    kinds = [kind for kind, _ in w.requests]
    for kind, a in zip(kinds, answers, strict=True):
        if a.prompt_tokens <= 0:
            raise RuntimeError(f"{variant.name}: an answer without usage (prompt_tokens {a.prompt_tokens})")
        _check_marks(variant, kind, a)
    system = [a for kind, a in zip(kinds, answers, strict=True) if kind != "flood"]
    later = system[2:]  # each system prompt's first request is cold in every variant
    return {
        "cached_share": sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers),
        "system_cached_share": sum(a.cached_tokens for a in later) / sum(a.prompt_tokens for a in later),
        "ttft": [a.ttft_s for a in later],
        "system_cached_tokens": [a.cached_tokens for a in system],
        "flood_cached_tokens": sum(a.cached_tokens for kind, a in zip(kinds, answers, strict=True) if kind == "flood"),
        "prompt_tokens": sum(a.prompt_tokens for a in answers),
        "wall_s": wall,
        "marks": [(kind, _marks_of(a)) for kind, a in zip(kinds, answers, strict=True) if kind != "flood"],
    }


def _retained(a: Answer) -> int:
    info = a.kvflow.get("prompt_cache") or {}
    return sum(int(r["end"]) - int(r["start"]) for r in info.get("retained") or [])


def _check_marks(variant: Variant, kind: str, a: Answer) -> None:
    """A marked request's answer reports retained tokens; an unmarked one reports none."""
    if kind != "flood" and variant.reports:
        if _retained(a) <= 0:
            raise RuntimeError(f"{variant.name}: a marked {kind} request's answer reports nothing retained "
                               f"(kvflow: {a.kvflow})")
    elif (kind == "flood" or variant.name == BASELINE) and "prompt_cache" in a.kvflow:
        raise RuntimeError(f"{variant.name}: an unmarked {kind} request's answer reports prompt caching "
                           f"({a.kvflow['prompt_cache']})")


def _marks_of(a: Answer) -> dict[str, Any]:
    info = a.kvflow.get("prompt_cache") or {}
    return {"breakpoints": sorted({(b["kind"], b["position"]) for b in info.get("breakpoints") or []}),
            "retained_tokens": _retained(a), "source": info.get("source"),
            "durations_s": sorted({float(r["duration_s"]) for r in info.get("retained") or []})}


def bench_prompt_cache(model_dir: Path, logs: Path, *, variants: Sequence[Variant] = VARIANTS, rounds: int = 2,
                       max_tokens: int = 2, kv_tokens: int = 2048, workload: Workload | None = None,
                       say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """The variants on ``model_dir`` (see the module docstring); ``variants`` must include ``none``."""
    from openai_api.chat import load_chat_template
    from openai_api.tokenizers import load_tokenizer

    names = [v.name for v in variants]
    if BASELINE not in names or len(set(names)) != len(names):
        raise ValueError(f"variants must be named apart and include {BASELINE!r}: {names}")
    res = BenchResult("prompt-cache")
    w = workload or Workload()
    template, tokenizer = load_chat_template(model_dir), load_tokenizer(model_dir)
    # Where each system message ends as the template renders it: where its breakpoint should fall.
    system_end = {f"system-{d}": len(tokenizer.encode(template.render([{"role": "system", "content": s}],
                                                                       add_generation_prompt=False),
                                                      add_special_tokens=False))
                  for d, s in zip("AB", w.systems, strict=True)}
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    orders = []
    for r in range(rounds):
        order = list(variants[r % len(variants):]) + list(variants[:r % len(variants)])
        orders.append([v.name for v in order])
        say(f"round {r + 1}/{rounds}: starting {len(order)} nodes …")
        engines = start_nodes(model_dir, logs, [f"{v.name}-{r + 1}" for v in order],
                              num_blocks=kv_tokens // BLOCK_SIZE, block_size=BLOCK_SIZE, dtype="float32")
        try:
            for v in order:
                out = _run(engines[f"{v.name}-{r + 1}"], w, v, max_tokens)
                runs[v.name].append(out)
                say(f"  {v.name}: cached share {out['cached_share']:.3f} (system prompts "
                    f"{out['system_cached_share']:.3f}), TTFT p99 {percentile_ms(out['ttft'], 99):.0f} ms, "
                    f"{out['wall_s']:.0f} s")
        finally:
            stop_groups([e.proc for e in engines.values()], grace_s=30)
    _figures(res, runs, names)
    res.details.update({
        "model": model_dir.name, "dtype": "float32", "block_size": BLOCK_SIZE, "kv_tokens": kv_tokens,
        "max_tokens": max_tokens, "rounds": rounds, "orders": orders, "requests": len(w.requests),
        "system_requests": sum(kind != "flood" for kind, _ in w.requests), "bursts": w.bursts,
        "system_prompt_tokens": system_end,
        "marks": {name: _marks_summary(runs[name], system_end) for name in names},
    })
    for name, summary in res.details["marks"].items():
        if summary["breakpoints_elsewhere"]:
            say(f"  {name}: breakpoints not at the system message's end: {summary['breakpoints_elsewhere']}")
    return res


def _figures(res: BenchResult, runs: dict[str, list[dict[str, Any]]], names: list[str]) -> None:
    def figures(rounds: list[dict[str, Any]]) -> dict[str, float]:
        ttft = [t for r in rounds for t in r["ttft"]]
        return {"cached_share": statistics.median(r["cached_share"] for r in rounds),
                "system_cached_share": statistics.median(r["system_cached_share"] for r in rounds),
                "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99)}

    base = figures(runs[BASELINE])
    res.baseline.update({f"{BASELINE}_{k}": v for k, v in base.items()})
    per_round: dict[str, Any] = {}
    for name in names:
        per_round[name] = [{k: v for k, v in r.items() if k != "marks"} for r in runs[name]]
        if name == BASELINE:
            continue
        f = figures(runs[name])
        res.figures.update({f"{name}_{k}": v for k, v in f.items()})
        res.ratios[f"{name}_cached_share_vs_none"] = _ratio(f["cached_share"], base["cached_share"])
        res.goals[f"{name}_cached_share_vs_none"] = ">= 1.2"
        res.ratios[f"{name}_ttft_p99_vs_none"] = _ratio(f["ttft_p99_ms"], base["ttft_p99_ms"])
        res.goals[f"{name}_ttft_p99_vs_none"] = "<= 0.7"
    # every round's ratios (round i of a variant against round i of the baseline): the spread
    res.details["ratios_per_round"] = {
        name: [{"cached_share_vs_none": _ratio(r["cached_share"], b["cached_share"]),
                "ttft_p99_vs_none": _ratio(percentile_ms(r["ttft"], 99), percentile_ms(b["ttft"], 99))}
               for r, b in zip(runs[name], runs[BASELINE], strict=True)]
        for name in names if name != BASELINE}
    res.details["per_round"] = per_round


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def _marks_summary(rounds: list[dict[str, Any]], system_end: dict[str, int]) -> dict[str, Any]:
    """Per system prompt: the breakpoints, retained tokens and their lifetimes its answers reported
    (each distinct value once), and any breakpoint that fell elsewhere than the system message's end."""
    out: dict[str, Any] = {"breakpoints_elsewhere": []}
    for kind, end in system_end.items():
        seen = [m for r in rounds for k, m in r["marks"] if k == kind]
        points = sorted({tuple(p) for m in seen for p in m["breakpoints"]})
        out[kind] = {"breakpoints": [list(p) for p in points],
                     "retained_tokens": sorted({m["retained_tokens"] for m in seen}),
                     "durations_s": sorted({d for m in seen for d in m["durations_s"]}),
                     "sources": sorted({str(m["source"]) for m in seen})}
        out["breakpoints_elsewhere"] += [[kind, k, pos, end] for k, pos in points if pos != end]
    return out
