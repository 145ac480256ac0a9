"""Families added for issue 41 (generalization): statistics the first eight families lack —
arrival bursts, a steep Zipf skew, a long tail of prompt lengths, many tenants, prefixes shared at
several depths. Each is a deterministic function ``(n=6000, seed=…)`` at about the Mooncake
trace's prompt load, like those of :mod:`kvflow.sim.families` (whose helpers they use); their
registry entries are :data:`EXTRA_FAMILIES`, joined to the others in :mod:`kvflow.sim.workloads`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

from kvflow.sim.families import Unit, _blocks, _collect, _cum_zipf, _Keys, _lognormal, _zipf
from kvflow.sim.request import BLOCK_TOKENS, Labelled, SimRequest, pin


def _bursts(n: int, rng: random.Random, keys: _Keys, rate: float, burst_factor: float, on_s: float,
            off_s: float) -> list[Labelled]:
    apps = [keys.fresh(rng.randint(4, 16)) for _ in range(32)]
    cum = _cum_zipf(len(apps), 1.0)
    out: list[Labelled] = []
    t, on = 0.0, False
    switch = off_s * rng.uniform(0.75, 1.25)
    lo = rate * (on_s + off_s) / (burst_factor * on_s + off_s)  # the mean rate stays ``rate``
    while len(out) < n:
        r = lo * burst_factor if on else lo
        gap = rng.expovariate(r)
        if t + gap >= switch:  # memoryless: the next arrival is drawn again in the next period
            t, on = switch, not on
            switch = t + (on_s if on else off_s) * rng.uniform(0.75, 1.25)
            continue
        t += gap
        k = _zipf(rng, cum)
        user = keys.fresh(_blocks(rng, 8, 0.8, 1, 60))
        out.append(Labelled(SimRequest(t, tuple(apps[k] + user), round(_lognormal(rng, 250, 0.7, 10, 2000)),
                                       pin(len(apps[k])), len(apps[k])), "burst" if on else "calm", (k,)))
    return out


def bursts(n: int = 6000, seed: int = 9, rate: float = 3.9, burst_factor: float = 6.0, on_s: float = 20.0,
           off_s: float = 60.0) -> list[SimRequest]:
    """Arrivals in bursts: calm periods, then ``burst_factor`` × the calm rate for a while.

    Poisson arrivals whose rate alternates: calm periods of ``off_s`` (± 25 %, uniform) and bursts
    of ``on_s`` (± 25 %) at ``burst_factor`` × the calm rate, the mean rate ``rate`` per second.
    Each request is one of 32 app prompts of 4–16 blocks (Zipf 1.0; pinned) plus a log-normal
    ~8-block user part (1–60). In a burst the offered prompt load is ~1.4× the fleet's prefill
    capacity (8 nodes of 10k tokens/s): queues form on whichever nodes the router favours.
    """
    return [x.req for x in _bursts(n, random.Random(seed), _Keys(), rate, burst_factor, on_s, off_s)]


def _zipf_skew(n: int, rng: random.Random, keys: _Keys, rate: float, prefixes: int, s: float) -> list[Labelled]:
    docs = [keys.fresh(_blocks(rng, 12, 0.8, 2, 80)) for _ in range(prefixes)]
    cum = _cum_zipf(prefixes, s)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        i = _zipf(rng, cum)
        prompt = docs[i] + keys.fresh(_blocks(rng, 2, 0.6, 1, 10))
        out.append(Labelled(SimRequest(t, tuple(prompt), round(_lognormal(rng, 200, 0.7, 10, 2000))), "doc", (i,)))
    return out


def zipf_skew(n: int = 6000, seed: int = 10, rate: float = 5.75, prefixes: int = 20000,
              s: float = 1.3) -> list[SimRequest]:
    """A steep Zipf over shared documents: the first few take most requests, the rest a long tail.

    ``prefixes`` documents of log-normal ~12 blocks (2–80), popularity Zipf with exponent ``s``
    (1.3: the top document ~26 % of the requests, the top ten ~60 %, ~860 documents seen in 6,000);
    each request is a document
    plus ~2 fresh blocks (1–10; no retention hints). Poisson at ``rate`` per second. The top
    documents alone would fill one node's prefill capacity.
    """
    return [x.req for x in _zipf_skew(n, random.Random(seed), _Keys(), rate, prefixes, s)]


def _long_tail(n: int, rng: random.Random, keys: _Keys, rate: float, alpha: float) -> list[Labelled]:
    apps = [keys.fresh(rng.randint(2, 8)) for _ in range(16)]
    cum = _cum_zipf(len(apps), 0.8)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        k = _zipf(rng, cum)
        body = min(250, int(rng.paretovariate(alpha)))  # 1, 2, … blocks, P(> x) = x^-alpha
        out.append(Labelled(SimRequest(t, tuple(apps[k] + keys.fresh(body)), round(_lognormal(rng, 250, 0.7, 10,
                                                                                                 2000)),
                                       pin(len(apps[k])), len(apps[k])), "long" if body >= 32 else "short", (k,)))
    return out


def long_tail(n: int = 6000, seed: int = 11, rate: float = 5.5, alpha: float = 0.9) -> list[SimRequest]:
    """Prompt lengths with a Pareto tail: most requests short, a few up to 250 blocks (128k tokens).

    16 app prompts of 2–8 blocks (Zipf 0.8; pinned), then a body of ``floor(Pareto(alpha))``
    fresh blocks (1–250: half are 1 block, ~4 % are 32 or more and bring most of the tokens).
    Poisson at ``rate`` per second. One long prompt holds its node's prefill for seconds: the
    requests queued behind it make the TTFT tail.
    """
    return [x.req for x in _long_tail(n, random.Random(seed), _Keys(), rate, alpha)]


def _many_tenants(n: int, rng: random.Random, keys: _Keys, sessions_per_s: float, tenants: int) -> list[Labelled]:
    systems = [keys.fresh(rng.randint(2, 10)) for _ in range(tenants)]
    cum = _cum_zipf(tenants, 0.6)

    def units() -> Iterator[Unit]:
        t = 0.0
        for sid in itertools.count():
            t += rng.expovariate(sessions_per_s)
            k = _zipf(rng, cum)
            history = systems[k] + keys.fresh(_blocks(rng, 4, 0.8, 1, 30))
            reqs, at = [], t
            for turn in range(rng.randint(1, 5)):
                answer = round(_lognormal(rng, 250, 0.7, 20, 1500))
                reqs.append(Labelled(SimRequest(at, tuple(history), answer, pin(len(systems[k])), len(systems[k])),
                                     "turn", (k, sid, turn)))
                history = history + keys.fresh(max(1, round((answer + _lognormal(rng, 100, 1.0, 10, 4000))
                                                            / BLOCK_TOKENS)))
                at += answer / 30 + _lognormal(rng, 15.0, 1.0, 2.0, 600.0)
            yield t, reqs

    return _collect(units(), n)


def many_tenants(n: int = 6000, seed: int = 12, sessions_per_s: float = 2.2, tenants: int = 2000) -> list[SimRequest]:
    """Thousands of tenants, each with a system prompt of its own, in short conversations.

    ``tenants`` system prompts of 2–10 blocks (a flat Zipf 0.6: no tenant dominates; pinned);
    sessions start as a Poisson process (``sessions_per_s``) with a first message of ~4 blocks and
    1–5 turns, each adding the answer and a question, ~15 s apart. Little is shared across
    sessions, and the tenants' prompts together (~12,000 blocks) do not fit a node.
    """
    return [x.req for x in _many_tenants(n, random.Random(seed), _Keys(), sessions_per_s, tenants)]


def _prefix_tree(n: int, rng: random.Random, keys: _Keys, rate: float, fanout: tuple[int, ...]) -> list[Labelled]:
    # level d has fanout[0] × … × fanout[d] nodes, each some blocks after its parent
    levels: list[list[list[int]]] = [[[]]]
    for f in fanout:
        levels.append([parent + keys.fresh(rng.randint(2, 8)) for parent in levels[-1] for _ in range(f)])
    cums = [_cum_zipf(f, 1.0) for f in fanout]
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        depth = rng.randint(1, len(fanout))
        index = 0
        for d in range(depth):
            index = index * fanout[d] + _zipf(rng, cums[d])
        prefix = levels[depth][index]
        out.append(Labelled(SimRequest(t, tuple(prefix + keys.fresh(_blocks(rng, 2, 0.7, 1, 12))),
                                       round(_lognormal(rng, 200, 0.7, 10, 2000))), f"depth{depth}",
                            (depth, index)))
    return out


def prefix_tree(n: int = 6000, seed: int = 13, rate: float = 5.2,
                fanout: tuple[int, ...] = (3, 5, 8, 12)) -> list[SimRequest]:
    """Prompts that share prefixes at several depths: an org, a product, a team, a project.

    A tree of ``len(fanout)`` levels (fanouts 3, 5, 8, 12: 1,440 leaves), each node 2–8 blocks after
    its parent; a request picks a depth (1–4, uniform) and walks down it, each child by Zipf 1.0,
    then adds ~2 fresh blocks (1–12). Shallow prefixes are shared by many requests, deep ones by
    few: where a prompt's longest match is, and which node holds it, changes with the depth.
    Poisson at ``rate`` per second.
    """
    return [x.req for x in _prefix_tree(n, random.Random(seed), _Keys(), rate, fanout)]


#: Each family's labelled generator, its public function and its rate parameters (as
#: ``kvflow.sim.families._FAMILIES``).
EXTRA_FAMILIES: dict[str, tuple[Callable[..., list[Labelled]], Callable[..., list[SimRequest]], dict[str, int]]] = {
    "bursts": (_bursts, bursts, {"rate": 1}),
    "zipf_skew": (_zipf_skew, zipf_skew, {"rate": 1}),
    "long_tail": (_long_tail, long_tail, {"rate": 1}),
    "many_tenants": (_many_tenants, many_tenants, {"sessions_per_s": 1}),
    "prefix_tree": (_prefix_tree, prefix_tree, {"rate": 1}),
}
