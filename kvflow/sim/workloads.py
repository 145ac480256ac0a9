"""Workloads for the simulator: the Mooncake trace and generated families, in one shape.

A request is its arrival time, its prompt as block keys (one key per block of ``BLOCK_TOKENS``
tokens; equal key prefixes are equal prompt prefixes, as in the Mooncake trace), its output
length, and optionally the retention config a client would send.

The families (``GENERATORS``; docs/traces.md) are deterministic functions ``(n=6000, seed=…)``
with non-decreasing times, scaled for the benchmarks' capacities (one cache of 1,000–16,000
blocks, 8 nodes of 500–2,000) and with default rates chosen so that each offers about the prompt
load of the Mooncake conversation trace (~41k prompt tokens/s, ~80 blocks/s; the simulator
serves 10k tokens/s per node on 8 nodes). :func:`labelled` gives the same requests with what
each one is (its family, kind, session or chunks), for tests and analysis. :func:`as_trace` and
:func:`write_trace` turn a family into a Mooncake trace for the single-cache replays
(``kvflow.traces``, ``kvflow.anchors``) and ``kvflow bench kv --trace FILE``.

This module holds the mixture (:func:`shifting_mix`), ``GENERATORS``, :func:`labelled` and the
trace output; the request shape is in :mod:`kvflow.sim.request` and the families one by one in
:mod:`kvflow.sim.families` and :mod:`kvflow.sim.families_extra`. Every name of them all is importable from here.
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from kvflow.sim.families import (
    _FAMILIES,
    _Keys,
    agentic,
    chain_key,
    chunk_chain,
    hot_prefixes,
    multi_turn,
    one_shot,
    rag,
    scan,
    system_prompt_heavy,
)
from kvflow.sim.families_extra import EXTRA_FAMILIES, bursts, long_tail, many_tenants, prefix_tree, zipf_skew
from kvflow.sim.request import BLOCK_TOKENS, Labelled, SimRequest, mooncake, pin
from kvflow.traces import TraceRequest

__all__ = [
    "BLOCK_TOKENS",
    "GENERATORS",
    "MOONCAKE_PROMPT_TOKENS_PER_S",
    "SHIFTING_PHASES",
    "Labelled",
    "SimRequest",
    "agentic",
    "as_trace",
    "bursts",
    "chain_key",
    "chunk_chain",
    "hot_prefixes",
    "labelled",
    "long_tail",
    "many_tenants",
    "mooncake",
    "multi_turn",
    "one_shot",
    "pin",
    "prefix_tree",
    "rag",
    "scan",
    "shifting_mix",
    "system_prompt_heavy",
    "write_trace",
    "write_trace_requests",
    "zipf_skew",
]

#: Every family's labelled generator, public function and rate parameters: the first eight's
#: (:mod:`kvflow.sim.families`) and those added for issue 41 (:mod:`kvflow.sim.families_extra`).
FAMILIES = {**_FAMILIES, **EXTRA_FAMILIES}


# ------------------------------------------------------------------------------- the mixture

#: The Mooncake conversation trace's offered prefill load: its prompt tokens over its duration
#: (144.8M tokens of 12,031 requests in 3,537 s). The families' default rates aim at it.
MOONCAKE_PROMPT_TOKENS_PER_S = 40_937

#: The phases of ``shifting_mix``: each a third of the requests, by family and share of requests.
SHIFTING_PHASES: tuple[dict[str, float], ...] = (
    {"multi_turn": 0.7, "system_prompt": 0.15, "rag": 0.15},  # conversations
    {"scan": 0.5, "rag": 0.4, "multi_turn": 0.1},               # batch scans and retrieval
    {"agentic": 0.7, "multi_turn": 0.15, "rag": 0.15},          # agents
)


def _component(name: str, n: int, rng: random.Random, keys: _Keys, scale: float = 1.0,
               **params: float) -> list[Labelled]:
    """A family at its defaults (or ``params``), its arrival rate times ``scale`` (inner gaps unchanged)."""
    gen, public, rates = FAMILIES[name]
    kw = {k: p.default for k, p in inspect.signature(public).parameters.items() if k not in ("n", "seed")}
    kw.update(params)
    for k, exponent in rates.items():
        kw[k] *= scale ** exponent
    return gen(n, rng, keys, **kw)


def _shares(n: int, weights: dict[str, float]) -> dict[str, int]:
    counts = {k: round(n * w / sum(weights.values())) for k, w in weights.items()}
    biggest = max(weights, key=lambda k: weights[k])
    counts[biggest] += n - sum(counts.values())
    return counts


def _fitted(name: str, n: int, seed: str, keys: _Keys, span: float) -> list[Labelled]:
    """``n`` requests of a family at the arrival rate that makes them span about ``span`` seconds.

    The span shrinks with the rate, less than in proportion where sessions or tasks take time to
    ramp up, so the scale is found by a few fixed-point steps (``scale *= got / wanted``).
    """
    scale = 1.0
    for _ in range(8):
        got = _component(name, n, random.Random(seed), _Keys(), scale)[-1].req.t
        if abs(got - span) <= 0.02 * span:
            break
        scale *= got / span
    return _component(name, n, random.Random(seed), keys, scale)


def _shifting_mix(n: int, seed: int, phases: Sequence[dict[str, float]]) -> list[Labelled]:
    keys = _Keys()
    out: list[Labelled] = []
    start = 0.0
    per = [n // len(phases) + (1 if p < n % len(phases) else 0) for p in range(len(phases))]
    for p, weights in enumerate(phases):
        counts = {k: c for k, c in _shares(per[p], weights).items() if c}
        # The phase lasts as long as the trace takes to offer as many prompt tokens; each family's
        # share of the requests comes at the rate that spreads it over the whole phase.
        tokens = sum(len(x.req.keys) * BLOCK_TOKENS for k, c in counts.items()
                     for x in _component(k, c, random.Random(f"{seed}:{p}:{k}"), _Keys(), 1.0))
        span = tokens / MOONCAKE_PROMPT_TOKENS_PER_S
        phase: list[Labelled] = []
        for k, c in counts.items():
            part = _fitted(k, c, f"{seed}:{p}:{k}", keys, span)
            phase += [replace(x, req=replace(x.req, t=start + x.req.t), family=k, phase=p) for x in part]
        phase.sort(key=lambda x: x.req.t)
        out += phase
        start = phase[-1].req.t if phase else start
    return out


def shifting_mix(n: int = 6000, seed: int = 7) -> list[SimRequest]:
    """A mixture of the families whose mix shifts twice (``SHIFTING_PHASES``).

    The requests come in three phases of a third each, one after the other: conversations
    (multi-turn 70 %, system-prompt 15 %, RAG 15 %), then scans and retrieval (scan 50 %, RAG
    40 %, multi-turn 10 %), then agents (agentic 70 %, multi-turn 15 %, RAG 15 %), by share of
    requests. Within a phase each family runs with its own sessions, tasks and corpus (nothing
    carries over from one phase to the next but the cache), at the share of its default rate
    that makes the families span the phase together, so the load stays about the trace's. A
    policy tuned to the first phase is tested on the next two.
    """
    return [x.req for x in _shifting_mix(n, seed, SHIFTING_PHASES)]


GENERATORS: dict[str, Callable[..., list[SimRequest]]] = {
    "system_prompt": system_prompt_heavy,
    "multi_turn": multi_turn,
    "agentic": agentic,
    "rag": rag,
    "scan": scan,
    "shifting_mix": shifting_mix,
    "hot_prefixes": hot_prefixes,
    "one_shot": one_shot,
    "bursts": bursts,
    "zipf_skew": zipf_skew,
    "long_tail": long_tail,
    "many_tenants": many_tenants,
    "prefix_tree": prefix_tree,
}


def labelled(name: str, n: int = 6000, seed: int | None = None, **params: float) -> list[Labelled]:
    """``GENERATORS[name](n, seed, **params)``, each request with what it is (:class:`Labelled`)."""
    public = GENERATORS[name]
    s = inspect.signature(public).parameters["seed"].default if seed is None else seed
    if name == "shifting_mix":
        if params:
            raise TypeError("shifting_mix takes no parameters but n and seed")
        return _shifting_mix(n, s, SHIFTING_PHASES)
    return [replace(x, family=name) for x in _component(name, n, random.Random(s), _Keys(), 1.0, **params)]


# ------------------------------------------------------------------------------ as a trace


def as_trace(reqs: Sequence[SimRequest]) -> list[TraceRequest]:
    """The requests as a Mooncake trace: times in seconds (to the millisecond, as the format
    keeps them), ``input_length`` = blocks × 512, the output length, and keys renumbered
    0, 1, 2 … in order of first appearance (as the trace's own ids; the same equalities)."""
    ids: dict[int, int] = {}
    out = []
    for r in reqs:
        hash_ids = tuple(ids.setdefault(k, len(ids)) for k in r.keys)
        out.append(TraceRequest(round(r.t * 1000) / 1000, len(r.keys) * BLOCK_TOKENS, r.output_tokens, hash_ids))
    return out


def write_trace_requests(trace: Iterable[TraceRequest], path: str | Path) -> Path:
    """Write a trace as Mooncake JSON lines: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    p = Path(path)
    with p.open("w") as f:
        for r in trace:
            f.write(json.dumps({"timestamp": round(r.timestamp_s * 1000), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
    return p


def write_trace(reqs: Sequence[SimRequest], path: str | Path) -> Path:
    """Write generated requests as a Mooncake trace (:func:`as_trace`), for ``kvflow bench kv --trace``."""
    return write_trace_requests(as_trace(reqs), path)
