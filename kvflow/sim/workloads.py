"""Workloads for the simulator: the Mooncake trace and generators, in one shape.

A request is its arrival time, its prompt as block keys (one key per block of ``BLOCK_TOKENS``
tokens; equal key prefixes are equal prompt prefixes, as in the Mooncake trace), its output
length, and optionally the retention config a client would send.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange
from kvflow.traces import TRACE_BLOCK_TOKENS, load_trace

BLOCK_TOKENS = TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class SimRequest:
    t: float
    keys: tuple[int, ...]
    output_tokens: int
    retention: KvCacheRetentionConfig | None = None
    #: Blocks a client would pin (a system prompt, tool definitions), for the "priority" policy.
    pinned_blocks: int = 0


def pin(blocks: int, *, priority: int = 100, rest: int = 35) -> KvCacheRetentionConfig | None:
    if blocks <= 0:
        return None
    return KvCacheRetentionConfig((TokenRange(0, blocks * BLOCK_TOKENS, priority),
                                   TokenRange(blocks * BLOCK_TOKENS, None, rest)))


def mooncake(path: str | Path | None = None, limit: int | None = None) -> list[SimRequest]:
    """The trace; its first block (shared by every request: a system prompt) is what a client pins."""
    out = []
    for r in load_trace(path, limit):
        pinned = 1 if r.hash_ids and r.hash_ids[0] == 0 else 0
        out.append(SimRequest(r.timestamp_s, r.hash_ids, r.output_length, pin(pinned), pinned))
    return out


class _Keys:
    def __init__(self) -> None:
        self.next = 1 << 40  # never collides with trace ids

    def fresh(self, n: int) -> list[int]:
        keys = list(range(self.next, self.next + n))
        self.next += n
        return keys


def system_prompt_heavy(n: int = 6000, seed: int = 1, rate: float = 4.0) -> list[SimRequest]:
    """Many requests under a few long system prompts (Zipf popularity) plus one-off user turns."""
    rng = random.Random(seed)
    keys = _Keys()
    systems = [keys.fresh(rng.randint(4, 12)) for _ in range(24)]
    weights = [1 / (i + 1) ** 0.9 for i in range(len(systems))]
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        s = rng.choices(systems, weights)[0]
        user = keys.fresh(rng.randint(2, 10))
        out.append(SimRequest(t, tuple(s + user), rng.randint(50, 400), pin(len(s)), len(s)))
    return out


def multi_turn(n: int = 6000, seed: int = 2, rate: float = 4.0) -> list[SimRequest]:
    """Conversations: each turn sends the whole history again, plus the last answer and a question."""
    rng = random.Random(seed)
    keys = _Keys()
    system = keys.fresh(3)
    sessions: list[list[int]] = []
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        if sessions and rng.random() < 0.7:
            i = rng.randrange(len(sessions))
            sessions[i] = sessions[i] + keys.fresh(rng.randint(1, 3))
            prompt = sessions[i]
            if len(prompt) > 60:
                sessions.pop(i)
        else:
            prompt = system + keys.fresh(rng.randint(1, 4))
            sessions.append(prompt)
            if len(sessions) > 400:
                sessions.pop(0)
        out.append(SimRequest(t, tuple(prompt), rng.randint(100, 600), pin(len(system)), len(system)))
    return out


def agentic(n: int = 6000, seed: int = 3, rate: float = 6.0) -> list[SimRequest]:
    """Agents: large tool definitions per agent type, and a context that grows step by step."""
    rng = random.Random(seed)
    keys = _Keys()
    tools = [keys.fresh(rng.randint(8, 20)) for _ in range(6)]
    tasks: list[tuple[int, list[int], int]] = []  # (tool set, context, steps left)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        if not tasks or rng.random() < 0.15:
            k = rng.randrange(len(tools))
            tasks.append((k, keys.fresh(rng.randint(1, 3)), rng.randint(3, 15)))
        i = rng.randrange(len(tasks))
        k, ctx, left = tasks[i]
        ctx = ctx + keys.fresh(rng.randint(1, 2))  # the last tool call and its result
        tasks[i] = (k, ctx, left - 1)
        if left <= 1:
            tasks.pop(i)
        prompt = tools[k] + ctx
        out.append(SimRequest(t, tuple(prompt), rng.randint(20, 200), pin(len(tools[k])), len(tools[k])))
    return out


def one_shot(n: int = 6000, seed: int = 4, rate: float = 4.0) -> list[SimRequest]:
    """Unrelated prompts: nothing to reuse (the floor)."""
    rng = random.Random(seed)
    keys = _Keys()
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, tuple(keys.fresh(rng.randint(2, 16))), rng.randint(50, 400)))
    return out


GENERATORS: dict[str, Callable[..., list[SimRequest]]] = {
    "system_prompt": system_prompt_heavy,
    "multi_turn": multi_turn,
    "agentic": agentic,
    "one_shot": one_shot,
}
