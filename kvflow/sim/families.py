"""The generated workload families (docs/traces.md), one by one: each a deterministic function
``(n=6000, seed=…)`` of non-decreasing times, with its labelled generator (the same requests with
what each one is) and the parameters that set its rate (``_FAMILIES``).

They are scaled for the benchmarks' capacities (one cache of 1,000–16,000 blocks, 8 nodes of
500–2,000) and their default rates chosen so that each offers about the prompt load of the
Mooncake conversation trace (~41k prompt tokens/s, ~80 blocks/s; the simulator serves 10k
tokens/s per node on 8 nodes). Their mixture, the registry :data:`~kvflow.sim.workloads.GENERATORS`
and the trace I/O are in :mod:`kvflow.sim.workloads`.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence

from kvflow.sim.request import BLOCK_TOKENS, Labelled, SimRequest, pin


class _Keys:
    def __init__(self, start: int = 1 << 40) -> None:
        self.next = start  # never collides with trace ids

    def fresh(self, n: int) -> list[int]:
        keys = list(range(self.next, self.next + n))
        self.next += n
        return keys


# --------------------------------------------------------------------------------- helpers


def _cum_zipf(n: int, s: float) -> list[float]:
    """Cumulative Zipf weights of ranks 1..n (for ``rng.choices(..., cum_weights=…)``: O(log n))."""
    return list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))


def _zipf(rng: random.Random, cum: list[float]) -> int:
    return rng.choices(range(len(cum)), cum_weights=cum)[0]


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def _blocks(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return round(_lognormal(rng, median, sigma, lo, hi))


def chain_key(prev: int, part: int, index: int) -> int:
    """The key of block ``index`` of part ``part`` (a document chunk) placed after the block ``prev``.

    KV depends on everything before it: the same chunk after a different block is different KV.
    Keys derive from the prefix (a hash of the previous key, the part and the index, in
    ``[2^62, 2^63)``: apart from ``_Keys``' counters), as the Mooncake trace's ids are remapped by
    prefix, so equal keys mean equal prefixes.
    """
    h = hashlib.blake2b(f"{prev}:{part}:{index}".encode(), digest_size=8).digest()
    return (1 << 62) | (int.from_bytes(h, "little") & ((1 << 62) - 1))


def chunk_chain(prefix: Sequence[int], chunks: Sequence[tuple[int, int]]) -> list[int]:
    """``prefix`` then each ``(chunk id, blocks)`` in order, every block keyed by :func:`chain_key`."""
    keys = list(prefix)
    prev = keys[-1] if keys else 0
    for chunk, blocks in chunks:
        for j in range(blocks):
            prev = chain_key(prev, chunk, j)
            keys.append(prev)
    return keys


Unit = tuple[float, list[Labelled]]


def _collect(units: Iterator[Unit], n: int) -> list[Labelled]:
    """The first ``n`` requests by time of units (sessions, tasks …) given in order of start time.

    Each unit's requests come at or after its start, so once ``n`` requests come before the
    next unit's start, no later unit can change the first ``n``.
    """
    out: list[Labelled] = []
    pending: list[float] = []
    final = 0
    for start, reqs in units:
        while pending and pending[0] < start:
            heapq.heappop(pending)
            final += 1
        if final >= n:
            break
        out.extend(reqs)
        for r in reqs:
            heapq.heappush(pending, r.req.t)
    out.sort(key=lambda x: x.req.t)
    return out[:n]


# ------------------------------------------------------------------------------- families


def _system_prompt(n: int, rng: random.Random, keys: _Keys, rate: float) -> list[Labelled]:
    systems = [keys.fresh(rng.randint(4, 12)) for _ in range(24)]
    weights = [1 / (i + 1) ** 0.9 for i in range(len(systems))]
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        k = rng.choices(range(len(systems)), weights)[0]
        s = systems[k]
        user = keys.fresh(rng.randint(2, 10))
        out.append(Labelled(SimRequest(t, tuple(s + user), rng.randint(50, 400), pin(len(s)), len(s)),
                            "request", (k,)))
    return out


def system_prompt_heavy(n: int = 6000, seed: int = 1, rate: float = 6.1) -> list[SimRequest]:
    """Many requests under a few long system prompts plus one-off user turns.

    24 system prompts of 4–12 blocks (Zipf popularity, exponent 0.9; pinned at priority 100), each
    request one of them plus 2–10 fresh blocks; Poisson arrivals at ``rate`` per second. The
    system prompts (~190 blocks) fit any cache of the benchmarks, so the LRU hit rate is about
    their share of the blocks (~0.55) from 1,000 blocks on: capacity matters below that, as in
    the priority experiment of ``kvflow sim`` (one node of 128 blocks). The keys are those the
    generator made before the default rate was raised from 4 to 6.1 per second (only the times
    changed), so that experiment's LRU and priority figures stay as they were.
    """
    return [x.req for x in _system_prompt(n, random.Random(seed), _Keys(), rate)]


def _multi_turn_session(rng: random.Random, keys: _Keys, start: float, system: list[int], sid: int,
                        think_median_s: float, think_sigma: float) -> list[Labelled]:
    turns = _blocks(rng, 5, 0.9, 1, 60)
    history = system + keys.fresh(_blocks(rng, 6, 1.0, 1, 48))  # the first message (sometimes a pasted document)
    out, t = [], start
    for turn in range(turns):
        answer = round(_lognormal(rng, 350, 0.7, 20, 2000))
        out.append(Labelled(SimRequest(t, tuple(history), answer, pin(len(system)), len(system)), "turn",
                            (sid, turn)))
        question = _lognormal(rng, 150, 1.2, 10, 8000)
        history = history + keys.fresh(max(1, round((answer + question) / BLOCK_TOKENS)))
        if len(history) > 256:  # 128k tokens: the context is full
            break
        # the answer streams at ~30 tokens/s, then the user thinks (heavy-tailed: seconds to an hour)
        t += answer / 30 + _lognormal(rng, think_median_s, think_sigma, 2.0, 3 * 3600.0)
    return out


def _multi_turn(n: int, rng: random.Random, keys: _Keys, sessions_per_s: float, think_median_s: float,
                think_sigma: float) -> list[Labelled]:
    systems = [keys.fresh(rng.randint(2, 6)) for _ in range(8)]
    cum = _cum_zipf(len(systems), 1.0)

    def units() -> Iterator[Unit]:
        t = 0.0
        for sid in itertools.count():
            t += rng.expovariate(sessions_per_s)
            system = systems[_zipf(rng, cum)]
            yield t, _multi_turn_session(rng, keys, t, system, sid, think_median_s, think_sigma)

    return _collect(units(), n)


def multi_turn(n: int = 6000, seed: int = 2, sessions_per_s: float = 1.3, think_median_s: float = 40.0,
               think_sigma: float = 1.6) -> list[SimRequest]:
    """Conversations with session gaps: each turn resends the whole history, the last answer and a question.

    Sessions start as a Poisson process (``sessions_per_s``) under one of 8 system prompts of 2–6
    blocks (Zipf; pinned). The first message is log-normal around 6 blocks (1–48: sometimes a
    pasted document); a session has log-normal ~5 turns (1–60); each turn's prompt is the previous
    turn's keys plus ``round((answer + question) / 512)`` (at least 1) fresh blocks, the answer
    (the turn's output) log-normal around 350 tokens, the question around 150 (10–8,000); a
    context over 256 blocks ends the session. Between two turns: the answer at 30 tokens/s, then a
    think time log-normal with median ``think_median_s`` and shape ``think_sigma`` (defaults: 40 s
    median, 10 % over 5 min, 1 % over 25 min, at most 3 h), so some sessions come back after an
    LRU cache has forgotten them. About 4.9 requests/s of ~16 blocks (~310 sessions open).
    """
    return [x.req for x in _multi_turn(n, random.Random(seed), _Keys(), sessions_per_s, think_median_s,
                                       think_sigma)]


def _agentic_task(rng: random.Random, keys: _Keys, start: float, tools: list[int], tid: int,
                  gap_median_s: float) -> list[Labelled]:
    steps = _blocks(rng, 9, 0.8, 2, 80)
    ctx = keys.fresh(_blocks(rng, 2, 0.8, 1, 30))  # the task (and what the user attached)
    out, t = [], start
    for step in range(steps):
        call = round(_lognormal(rng, 120, 0.6, 20, 1500))  # the model's output: a tool call
        out.append(Labelled(SimRequest(t, tuple(tools + ctx), call, pin(len(tools)), len(tools)), "step",
                            (tid, step)))
        result = _lognormal(rng, 800, 1.0, 20, 16000)  # a file, a page, a test log …
        ctx = ctx + keys.fresh(max(1, round((call + result) / BLOCK_TOKENS)))
        if len(tools) + len(ctx) > 256:
            break
        t += call / 50 + _lognormal(rng, gap_median_s, 1.2, 0.2, 600.0)  # decode, then the tool runs
    return out


def _agentic(n: int, rng: random.Random, keys: _Keys, tasks_per_s: float, gap_median_s: float) -> list[Labelled]:
    tools = [keys.fresh(rng.randint(8, 40)) for _ in range(8)]
    cum = _cum_zipf(len(tools), 0.8)

    def units() -> Iterator[Unit]:
        t = 0.0
        for tid in itertools.count():
            t += rng.expovariate(tasks_per_s)
            yield t, _agentic_task(rng, keys, t, tools[_zipf(rng, cum)], tid, gap_median_s)

    return _collect(units(), n)


def agentic(n: int = 6000, seed: int = 3, tasks_per_s: float = 0.13, gap_median_s: float = 8.0) -> list[SimRequest]:
    """Agents in tool loops: each step resends the tool definitions and the whole growing context.

    8 agent types with tool definitions of 8–40 blocks (Zipf 0.8; pinned). Tasks start as a
    Poisson process (``tasks_per_s``), each with a context of log-normal ~2 blocks and ~9 steps
    (2–80). Each step's output is a tool call (~120 tokens); the next step adds the call and the
    tool's result (log-normal around 800 tokens, up to 16k) to the context. Between steps: the
    call decoded at 50 tokens/s, then the tool runs (log-normal, median ``gap_median_s``, up to
    10 min). Many tasks run at once (~26), so a small cache loses a context between two steps.
    About 1.5 requests/s of ~54 blocks.
    """
    return [x.req for x in _agentic(n, random.Random(seed), _Keys(), tasks_per_s, gap_median_s)]


def _rag(n: int, rng: random.Random, keys: _Keys, rate: float, corpus: int, topics: int) -> list[Labelled]:
    systems = [keys.fresh(rng.randint(2, 4)) for _ in range(4)]
    sys_cum = _cum_zipf(len(systems), 1.0)
    sizes = [rng.randint(2, 4) for _ in range(corpus)]
    corpus_cum = _cum_zipf(corpus, 1.0)
    # A topic (a question people ask again) has 10 relevant chunks, best first, drawn by popularity.
    ranked: list[list[int]] = []
    for _ in range(topics):
        chosen: list[int] = []
        while len(chosen) < 10:
            c = _zipf(rng, corpus_cum)
            if c not in chosen:
                chosen.append(c)
        ranked.append(chosen)
    topic_cum = _cum_zipf(topics, 0.9)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        s = _zipf(rng, sys_cum)
        k = rng.randint(3, 6)
        # The retriever's scores are noisy: the same topic brings back the same chunks in a varying order.
        cands = ranked[_zipf(rng, topic_cum)]
        order = sorted(range(len(cands)), key=lambda i: i + rng.gauss(0.0, 1.2))
        chunks = [cands[i] for i in order[:k]]
        prompt = chunk_chain(systems[s], [(c, sizes[c]) for c in chunks]) + keys.fresh(1)  # + the question
        out.append(Labelled(SimRequest(t, tuple(prompt), round(_lognormal(rng, 250, 0.6, 20, 1500)),
                                       pin(len(systems[s])), len(systems[s])), "rag", (s, *chunks)))
    return out


def rag(n: int = 6000, seed: int = 5, rate: float = 4.5, corpus: int = 20000, topics: int = 3000) -> list[SimRequest]:
    """Retrieval-augmented generation: a system prompt, k retrieved chunks in varying order, the question.

    4 system prompts of 2–4 blocks (Zipf; pinned), then 3–6 chunks of 2–4 blocks from a corpus of
    ``corpus`` chunks, then a 1-block question. Requests ask about ``topics`` topics (Zipf 0.9);
    each topic has 10 relevant chunks drawn by the corpus' popularity (Zipf 1.0), ranked; a
    request takes the top k of that ranking under Gaussian noise (σ = 1.2 ranks), so the same
    topic brings back mostly the same chunks in a varying order. Under prefix semantics only the
    leading shared run is reusable: a chunk's keys depend on everything before it
    (:func:`chain_key`), so the same chunk after a different one is different KV. Poisson
    arrivals at ``rate`` per second, ~18 blocks each.
    """
    return [x.req for x in _rag(n, random.Random(seed), _Keys(), rate, corpus, topics)]


def _scan(n: int, rng: random.Random, keys: _Keys, user_rate: float, users: int, scan_every_s: float,
          scan_requests: int) -> list[Labelled]:
    app = keys.fresh(2)
    prefixes = [app + keys.fresh(_blocks(rng, 8, 0.7, 2, 40)) for _ in range(users)]
    cum = _cum_zipf(users, 1.0)

    def units() -> Iterator[Unit]:
        t_user, t_scan = rng.expovariate(user_rate), scan_every_s / 2
        for i in itertools.count():
            if t_user <= t_scan:
                u = _zipf(rng, cum)
                p = prefixes[u]
                req = SimRequest(t_user, tuple(p + keys.fresh(_blocks(rng, 1.5, 0.6, 1, 8))),
                                 round(_lognormal(rng, 200, 0.7, 10, 1500)), pin(len(app)), len(app))
                yield t_user, [Labelled(req, "user", (u,))]
                t_user += rng.expovariate(user_rate)
            else:  # a batch job: many long unique prompts at once (summarize these documents …)
                burst, t = [], t_scan
                for _ in range(scan_requests):
                    t += rng.expovariate(30.0)
                    req = SimRequest(t, tuple(keys.fresh(_blocks(rng, 24, 0.5, 8, 120))),
                                     round(_lognormal(rng, 150, 0.5, 10, 1000)))
                    burst.append(Labelled(req, "scan", (i,)))
                yield t_scan, burst
                t_scan += scan_every_s * rng.uniform(0.75, 1.25)

    return _collect(units(), n)


def scan(n: int = 6000, seed: int = 6, user_rate: float = 4.0, users: int = 1500, scan_every_s: float = 150.0,
         scan_requests: int = 150) -> list[SimRequest]:
    """A hot working set of recurring users, interleaved with periodic one-shot scans that flush LRU.

    ``users`` users (Zipf 1.0), each with a prefix of its own: an app system prompt of 2 blocks
    (shared, pinned) plus log-normal ~8 blocks (2–40: a profile, a project's context); a user's
    request is its prefix plus ~1.5 fresh blocks, Poisson at ``user_rate`` per second. Every
    ``scan_every_s`` (±25 %) a batch job sends ``scan_requests`` unique prompts of log-normal ~25
    blocks (8–120) at 30 per second: ~4,100 blocks that nothing else shares, enough to flush an
    LRU cache of 1,000 or 4,000 blocks of the hot prefixes. About 4 user requests/s of ~14 blocks
    plus one scan request per second (on average) of ~28 blocks.
    """
    return [x.req for x in _scan(n, random.Random(seed), _Keys(), user_rate, users, scan_every_s, scan_requests)]


def _hot_prefixes(n: int, rng: random.Random, keys: _Keys, rate: float, hot: int, hot_share: float,
                  cold: int) -> list[Labelled]:
    hots = [keys.fresh(rng.randint(20, 40)) for _ in range(hot)]
    hot_cum = _cum_zipf(hot, 0.5)
    colds = [keys.fresh(_blocks(rng, 8, 0.8, 2, 40)) for _ in range(cold)]
    cold_cum = _cum_zipf(cold, 0.8)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        if rng.random() < hot_share:
            kind, i = "hot", _zipf(rng, hot_cum)
            prefix = hots[i]
        else:
            kind, i = "cold", _zipf(rng, cold_cum)
            prefix = colds[i]
        prompt = prefix + keys.fresh(_blocks(rng, 2, 0.7, 1, 12))
        out.append(Labelled(SimRequest(t, tuple(prompt), round(_lognormal(rng, 250, 0.7, 10, 2000)),
                                       pin(len(prefix)), len(prefix)), kind, (i,)))
    return out


def hot_prefixes(n: int = 6000, seed: int = 8, rate: float = 3.1, hot: int = 4, hot_share: float = 0.7,
                 cold: int = 6000) -> list[SimRequest]:
    """A few very hot long prefixes and a long tail of cold ones: where KV-aware routing piles up.

    ``hot`` prefixes of 20–40 blocks (Zipf 0.5 among them) take ``hot_share`` of the requests;
    the rest go to ``cold`` prefixes of log-normal ~8 blocks (2–40, Zipf 0.8: a long tail). Each
    request is its prefix (pinned) plus ~2 fresh blocks (1–12). A router that follows the cache
    sends most requests to the one or two nodes holding the hot prefixes, whatever their load.
    Poisson at ``rate`` per second, ~26 blocks each (~31 under a hot prefix, ~14 under a cold one).
    """
    return [x.req for x in _hot_prefixes(n, random.Random(seed), _Keys(), rate, hot, hot_share, cold)]


def _one_shot(n: int, rng: random.Random, keys: _Keys, rate: float) -> list[Labelled]:
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        req = SimRequest(t, tuple(keys.fresh(_blocks(rng, 12, 0.9, 1, 200))), round(_lognormal(rng, 250, 0.7, 10,
                                                                                                 2000)))
        out.append(Labelled(req, "one_shot"))
    return out


def one_shot(n: int = 6000, seed: int = 4, rate: float = 4.4) -> list[SimRequest]:
    """Unrelated prompts, nothing to reuse (the floor): log-normal ~12 blocks (1–200), Poisson at ``rate``/s."""
    return [x.req for x in _one_shot(n, random.Random(seed), _Keys(), rate)]


#: Each family's labelled generator, its public function (the defaults) and its rate parameters
#: (multiplied by ``scale ** exponent`` in a mixture).
_FAMILIES: dict[str, tuple[Callable[..., list[Labelled]], Callable[..., list[SimRequest]], dict[str, int]]] = {
    "system_prompt": (_system_prompt, system_prompt_heavy, {"rate": 1}),
    "multi_turn": (_multi_turn, multi_turn, {"sessions_per_s": 1}),
    "agentic": (_agentic, agentic, {"tasks_per_s": 1}),
    "rag": (_rag, rag, {"rate": 1}),
    "scan": (_scan, scan, {"user_rate": 1, "scan_every_s": -1}),
    "hot_prefixes": (_hot_prefixes, hot_prefixes, {"rate": 1}),
    "one_shot": (_one_shot, one_shot, {"rate": 1}),
}
