"""``kvflow bench route``'s run with a real subword tokenizer (``bpe_*``).

A byte-level BPE of 32,768 ids trained here (``kvflow.bench.bpe``; kept under
``$TMPDIR/kvflow-bench-bpe``), a one-process router with it (``KVFLOW_ROUTER_TOKENIZER_DIR``),
multi-turn prompts of 2k–8k tokens whose previous turn it routed (``bpe_p50_ms``, ``bpe_p99_ms``:
its prefix cache hits; goal p50 ≤ 2.5 ms) and cold prompts (``bpe_cold_p50_ms``), next to
``tokenizers`` alone on the cold ones (the limit) and the same prompts through a router without
the prefix cache (``bpe_uncached_p50_ms``, the baseline); ``bpe_tokenize_share``: tokenizing and
hashing (replayed in this process, same prompts, same order) over the router's ``decision_ms``.
:func:`~kvflow.bench.route.bench_route` runs it: :func:`_bpe_prepare`, its token ids placed in
the fleet, then :func:`_bpe_routers` and :func:`_bpe_report`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from eventbus.hashing import prompt_hash_heads
from kvflow.bench.harness import BenchResult, percentile
from kvflow.bench.httpload import Connection, HttpError
from kvflow.bench.route_load import _loop_factory, _router


@dataclass
class _Replay:
    """The router's tokenizing and hashing alone, in this process (:func:`_bpe_replay`)."""

    #: seconds per prompt (the turns, then the cold prompts) of each way: ``cache`` (``HFTokenizer``
    #: with its prefix cache: tokenize and hash), ``whole`` (without), ``library`` (``tokenizers``'
    #: ``encode`` of the whole text, alone)
    times: dict[str, list[float]]
    #: of which hashing (``prompt_hash_heads``), per prompt
    hash_s: list[float]
    tokens: list[int]
    ids: list[array[int]]
    stats: Any


@dataclass
class _BpeWork:
    """The BPE run's inputs: a tokenizer trained here, and the prompts in the order they are sent."""

    folder: Path
    training_s: float
    vocab_size: int
    chars_per_token: float
    warm: list[str]
    #: every conversation's prompts, turn by turn round-robin over the conversations
    turns: list[str]
    #: the indices in ``turns`` of the prompts whose previous turn was routed before (turn 2 on)
    followups: list[int]
    #: the index in ``turns`` of each conversation's last prompt
    lasts: list[int]
    #: prompts never seen, 2k–8k tokens
    cold: list[str]
    replay: _Replay | None = None
    #: the run's own seconds (training included), for ``details``
    seconds: float = 0.0

    @property
    def placed(self) -> list[array[int]]:
        """Token ids put in the fleet (50–100 % cached on one to three nodes): each conversation's
        last prompt (so its history is cached), each cold prompt."""
        assert self.replay is not None
        return [self.replay.ids[i] for i in self.lasts] + self.replay.ids[len(self.turns):]


def _bpe_prepare(conversations: int, quick: bool, say: Callable[[str], None]) -> _BpeWork:
    """Train (or load) the byte-level BPE, make the prompts (``kvflow.bench.bpe``), replay them.

    32,768 ids on 24M characters (``--quick``: 8,192 on 4M); ``conversations`` chats of a 2k-token
    system prompt growing by 150–600-token answers and 20–150-token questions to ~8k tokens (the
    Mooncake trace's median prompt is 10.8k tokens among those that extend an earlier one, its
    median growth 488 tokens); 48 cold prompts of 2k–8k tokens (``--quick``: 8).
    """
    from tokenizers import Tokenizer as LibTokenizer

    from kvflow.bench import bpe

    t0 = time.perf_counter()
    vocab = bpe.vocabulary()
    size, corpus = (8192, 4_000_000) if quick else (32_768, 24_000_000)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "kvflow-bench-bpe"
    say(f"BPE tokenizer: {size:,} ids, trained on {corpus / 1e6:.0f}M characters (kept in {root}) …")
    folder, training_s = bpe.trained_tokenizer(root, size, corpus, vocab)
    tok = LibTokenizer.from_file(str(folder / "tokenizer.json"))
    rng = random.Random(23)
    sample = bpe.synthetic_text(rng, vocab, 200_000)
    cpt = len(sample) / len(tok.encode(sample).ids)
    chats = bpe.conversations(conversations, rng, vocab, chars_per_token=cpt)
    turns: list[str] = []
    followups: list[int] = []
    lasts = [0] * len(chats)
    for k in range(max(len(c.prompts) for c in chats)):
        for n, c in enumerate(chats):
            if k < len(c.prompts):
                if k:
                    followups.append(len(turns))
                lasts[n] = len(turns)
                turns.append(c.prompts[k])
    cold = [bpe.synthetic_text(rng, vocab, int(rng.randint(2048, 8192) * cpt)) for _ in range(8 if quick else 48)]
    warm = [bpe.synthetic_text(rng, vocab, int(2048 * cpt)) for _ in range(8)]
    work = _BpeWork(folder, training_s, int(tok.get_vocab_size()), cpt, warm, turns, followups, lasts, cold)
    say("BPE: tokenizing and hashing alone in this process; `tokenizers` alone …")
    work.replay = _bpe_replay(work)
    work.seconds = time.perf_counter() - t0
    return work


def _bpe_replay(work: _BpeWork) -> _Replay:
    """The prompts in the routers' order (so that the prefix cache and ``tokenizers``' own word
    cache go through the same states), the three ways (:class:`_Replay`) in turn on each prompt.
    In a tight loop, with the tokenizer's tables in the CPU's caches: a lower bound of what the
    router spends (which :func:`_bpe_report` measures in the router itself)."""
    from tokenizers import Tokenizer as LibTokenizer

    from openai_api.tokenizers import HFTokenizer

    path = work.folder / "tokenizer.json"
    cached, whole, lib = HFTokenizer(path), HFTokenizer(path, prefix_cache=False), LibTokenizer.from_file(str(path))
    out = _Replay({"cache": [], "whole": [], "library": []}, [], [], [], None)
    for i, text in enumerate([*work.warm, *work.turns, *work.cold]):
        t0 = time.perf_counter()
        ids = cached.encode_compact(text)
        t1 = time.perf_counter()
        prompt_hash_heads(ids, 32)
        t2 = time.perf_counter()
        prompt_hash_heads(whole.encode_compact(text), 32)
        t3 = time.perf_counter()
        want = lib.encode(text).ids
        t4 = time.perf_counter()
        if list(ids) != want:
            raise RuntimeError("the prefix cache's ids differ from tokenizers' own")
        if i >= len(work.warm):
            for way, dt in (("cache", t2 - t0), ("whole", t3 - t2), ("library", t4 - t3)):
                out.times[way].append(dt)
            out.hash_s.append(t2 - t1)
            out.tokens.append(len(ids))
            out.ids.append(array("I", ids))
    out.stats = cached.prefix_cache_stats()
    return out


@dataclass
class _Routed:
    """One router's answers to a list of prompts, in order: as text, then as their token ids
    (``server_ids``: its decision without tokenizing)."""

    latencies: list[float] = field(default_factory=list)
    server: list[float] = field(default_factory=list)
    server_ids: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    matched_tokens: list[int] = field(default_factory=list)


async def _route_interleaved(ports: list[int], texts: list[str], ids: list[array[int]] | None) -> list[_Routed]:
    """Each prompt through each router in turn (who goes first alternates), one at a time, on a
    keep-alive connection each, as text and then (with ``ids``) as its token ids: a slow phase of
    the machine weighs on all alike."""
    conns = [Connection("127.0.0.1", port) for port in ports]
    await asyncio.gather(*(c.open() for c in conns))
    out = [_Routed() for _ in ports]

    async def post(r: int, body: bytes) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        status, answer = await conns[r].post("/v1/route", body)
        elapsed = time.perf_counter() - t0
        if status != 200:
            raise HttpError(f"HTTP {status}: {answer[:300]!r}")
        return elapsed, msgspec.json.decode(answer)

    try:
        for i, text in enumerate(texts):
            body = msgspec.json.encode({"prompt": text})
            as_ids = msgspec.json.encode({"token_ids": ids[i].tolist()}) if ids else b""
            for r in range(len(conns)) if i % 2 == 0 else range(len(conns) - 1, -1, -1):
                elapsed, doc = await post(r, body)
                out[r].latencies.append(elapsed)
                out[r].server.append(doc["decision_ms"] / 1000)
                out[r].prompt_tokens.append(doc["prompt_tokens"])
                out[r].matched_tokens.append(doc["matched_tokens"])
                if as_ids:
                    out[r].server_ids.append((await post(r, as_ids))[1]["decision_ms"] / 1000)
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    return out


def _bpe_routers(reader: str, work: _BpeWork, say: Callable[[str], None]) -> dict[str, tuple[_Routed, _Routed]]:
    """The multi-turn prompts, then the cold ones, one at a time, each through two one-process
    routers with the BPE tokenizer in turn: with its prefix cache, and without (the baseline).
    One process: the cache is a process's own (with ``--workers N`` a conversation hits it when
    it comes back to the same process)."""
    assert work.replay is not None
    t0 = time.perf_counter()
    env = {"KVFLOW_ROUTER_TOKENIZER_DIR": str(work.folder)}
    n = len(work.turns)
    with _router(reader, 1, {**env, "KVFLOW_TOKENIZER_PREFIX_CACHE": "on"}) as on, \
            _router(reader, 1, {**env, "KVFLOW_TOKENIZER_PREFIX_CACHE": "off"}) as off:
        say(f"BPE: {n} multi-turn prompts, then {len(work.cold)} cold ones, each through a router with the prefix "
            "cache and one without, as text and as token ids …")
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_route_interleaved([on, off], work.warm, None))
            turns = runner.run(_route_interleaved([on, off], work.turns, work.replay.ids[:n]))
            cold = runner.run(_route_interleaved([on, off], work.cold, work.replay.ids[n:]))
    work.seconds += time.perf_counter() - t0
    return {"cached": (turns[0], cold[0]), "uncached": (turns[1], cold[1])}


def _p(xs: Sequence[float], q: float = 50) -> float:
    """A percentile in milliseconds."""
    return percentile(list(xs), q) * 1000


def _share(routed: _Routed, hash_s: list[float], pick: list[int] | None = None) -> tuple[float, float]:
    """Tokenizing (measured in the router: its decision on the text less its decision on the same
    ids) and hashing (this process) over the router's decision, both medians; and the router's
    tokenizing alone, p50 ms."""
    idx = pick if pick is not None else list(range(len(routed.server)))
    tokenize = [routed.server[i] - routed.server_ids[i] for i in idx]
    both = [tokenize[k] + hash_s[i] for k, i in enumerate(idx)]
    return _p(both) / _p([routed.server[i] for i in idx]), _p(tokenize)


def _bpe_report(res: BenchResult, work: _BpeWork, routed: dict[str, tuple[_Routed, _Routed]]) -> None:
    """The BPE figures: the multi-turn prompts' decisions with the prefix cache and without, the
    cold prompts' next to ``tokenizers`` alone, and the share of tokenizing and hashing."""
    from dataclasses import asdict

    assert work.replay is not None
    rp, n = work.replay, len(work.turns)
    (mt, cold), (mt_off, cold_off) = routed["cached"], routed["uncached"]
    if not rp.tokens == mt.prompt_tokens + cold.prompt_tokens == mt_off.prompt_tokens + cold_off.prompt_tokens:
        raise RuntimeError("the prompts' token counts differ between the routers and the replay")
    fu = work.followups

    def follow(xs: list[float]) -> list[float]:
        return [xs[i] for i in fu]

    share, tokenize = _share(mt, rp.hash_s, fu)
    share_cold, tokenize_cold = _share(cold, rp.hash_s[n:])
    share_off, tokenize_off = _share(mt_off, rp.hash_s, fu)
    res.figures.update({
        "bpe_p50_ms": _p(follow(mt.latencies)), "bpe_p99_ms": _p(follow(mt.latencies), 99),
        "bpe_server_decision_p50_ms": _p(follow(mt.server)), "bpe_tokenize_p50_ms": tokenize,
        "bpe_cold_p50_ms": _p(cold.latencies), "bpe_cold_server_decision_p50_ms": _p(cold.server),
        "bpe_cold_tokenize_p50_ms": tokenize_cold,
        "bpe_tokenizers_alone_p50_ms": _p(rp.times["library"][n:]),
        "bpe_tokenize_share": share, "bpe_tokenize_share_cold": share_cold,
        "bpe_uncached_p50_ms": _p(follow(mt_off.latencies)), "bpe_uncached_p99_ms": _p(follow(mt_off.latencies), 99),
        "bpe_uncached_cold_p50_ms": _p(cold_off.latencies),
        "bpe_vocab_size": work.vocab_size,
    })
    res.ratios["bpe_p50_vs_uncached"] = res.figures["bpe_p50_ms"] / res.figures["bpe_uncached_p50_ms"]
    res.ratios["bpe_cold_p50_vs_tokenizers_alone"] = res.figures["bpe_cold_p50_ms"] / res.figures[
        "bpe_tokenizers_alone_p50_ms"]
    res.goals["bpe_p50_ms"] = "<= 2.5"
    followed = follow([float(t) for t in rp.tokens])
    res.details["bpe"] = {
        "training_s": round(work.training_s, 2), "trained_in_s": _trained_in(work.folder),
        "vocab_size": work.vocab_size, "chars_per_token": round(work.chars_per_token, 2), "router_processes": 1,
        "multi_turn_prompts": len(fu), "all_prompts": n, "cold_prompts": len(work.cold),
        "multi_turn_prompt_tokens_mean": round(sum(followed) / len(followed)),
        "multi_turn_prompt_tokens_max": round(max(followed)),
        "cold_prompt_tokens_mean": round(sum(rp.tokens[n:]) / len(work.cold)),
        "multi_turn_server_decision_as_ids_p50_ms": _p(follow(mt.server_ids)),
        "uncached_tokenize_share": share_off, "uncached_tokenize_p50_ms": tokenize_off,
        "uncached_server_decision_p50_ms": _p(follow(mt_off.server)),
        "hash_p50_ms": _p(follow(rp.hash_s)), "hash_cold_p50_ms": _p(rp.hash_s[n:]),
        "replay_tokenize_hash_p50_ms": {way: _p(follow(t)) for way, t in rp.times.items()},
        "replay_tokenize_hash_cold_p50_ms": {way: _p(t[n:]) for way, t in rp.times.items()},
        "multi_turn_matched_share": sum(follow([float(m) for m in mt.matched_tokens])) / sum(followed),
        "prefix_cache": asdict(rp.stats) if rp.stats is not None else None,
        "trace_prefix_reuse": _trace_reuse(),
        "seconds": round(work.seconds, 1),
    }


def _trained_in(folder: Path) -> float | None:
    """The seconds the kept tokenizer took to train (when this run loaded it: ``training_s`` 0)."""
    try:
        return round(float(json.loads((folder / "training.json").read_text())["seconds"]), 2)
    except (OSError, ValueError, KeyError):
        return None


def _trace_reuse() -> dict[str, object] | None:
    """The prefix cache's policy on the Mooncake trace (``kvflow.bench.bpe.trace_prefix_reuse``)."""
    from kvflow.bench.bpe import trace_prefix_reuse
    from kvflow.traces import load_trace

    try:
        return trace_prefix_reuse(load_trace())
    except FileNotFoundError:
        return None
