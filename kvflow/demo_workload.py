"""The requests ``kvflow demo`` sends, and how it measures them.

Two workloads with the same shape — long system prompts pinned at priority 100, conversations
whose history grows, one-off questions:

* :func:`completions` for the random-weight nodes (``/v1/completions``; text does not matter);
* :func:`chats` for a real model (``/v1/chat/completions`` with real questions): the pinned range
  is the system message's tokens as the model's chat template renders them (counted with the
  model's own tokenizer and template, so that the pin ends where the system prompt ends).

Every request is streamed, so that the time to its first token is measured as a client sees it.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SYSTEM_PROMPTS = [
    "You are the support assistant of an airline. Be precise about fares, baggage rules and "
    "connections; never invent a flight. Policies: ",
    "You are a careful code reviewer for a Python service. Point out bugs, unclear names, missing "
    "tests and security problems, in that order. Style guide: ",
    "You are a medical triage helper. You never diagnose; you ask about symptoms, duration and "
    "severity, and you send urgent cases to a doctor at once. Protocol: ",
]
TOPICS = ["refunds", "a lost bag", "a delayed flight", "seat upgrades", "pets on board", "a null check",
          "a race condition", "SQL injection", "logging", "a headache", "a sprained ankle", "a fever"]
#: One-off questions for a real model (the first is the README's example).
QUESTIONS = ["What is the capital of France?", "Name the three primary colors.", "What is 12 times 12?",
             "Which planet is closest to the sun?", "Translate 'thank you' into Spanish.",
             "What gas do plants take in from the air?", "How many days are in a leap year?",
             "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?"]
#: A request: its kind, the endpoint, the body.
Request = tuple[str, str, dict[str, Any]]


@dataclass
class DemoResult:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_node: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    cached_by_kind: Counter[str] = field(default_factory=Counter)
    prompt_by_kind: Counter[str] = field(default_factory=Counter)
    #: failed requests by their status and answer
    errors: Counter[str] = field(default_factory=Counter)
    #: time to first token (s) of the requests that found nothing cached, and of those that did
    ttft_cold: list[float] = field(default_factory=list)
    ttft_cached: list[float] = field(default_factory=list)
    #: (question, answer) of the one-off questions, in order
    answers: list[tuple[str, str]] = field(default_factory=list)

    def record(self, kind: str, node: str, usage: dict[str, Any], ttft: float | None) -> None:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.prompt_tokens += usage["prompt_tokens"]
        self.cached_tokens += cached
        self.by_node[node] += 1
        self.by_kind[kind] += 1
        self.prompt_by_kind[kind] += usage["prompt_tokens"]
        self.cached_by_kind[kind] += cached
        if ttft is not None:
            (self.ttft_cached if cached else self.ttft_cold).append(ttft)


def _policies(rng: random.Random) -> list[str]:
    policies = [" ".join(f"rule {i}: {rng.choice(TOPICS)} is handled per section {i}." for i in range(40))
                for _ in SYSTEM_PROMPTS]
    return [s + p for s, p in zip(SYSTEM_PROMPTS, policies, strict=True)]


def completions(n: int, seed: int = 7) -> Iterator[Request]:
    """The random-weight workload: text prompts, the system prompt's bytes (= tokens) pinned."""
    rng = random.Random(seed)
    systems = _policies(rng)
    sessions: list[tuple[int, str]] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.35 and sessions:
            i = rng.randrange(len(sessions))
            k, history = sessions[i]
            history += f"\nUser: and what about {rng.choice(TOPICS)}?\nAssistant: it depends on the case."
            sessions[i] = (k, history)
            yield "conversation", "/v1/completions", {"prompt": systems[k] + history, "max_tokens": 8,
                                                      "kv_retention": pin(len(systems[k]))}
        elif r < 0.8:
            k = rng.randrange(len(systems))
            history = f"\nUser: tell me about {rng.choice(TOPICS)}.\nAssistant: sure."
            sessions.append((k, history))
            yield "system prompt", "/v1/completions", {"prompt": systems[k] + history, "max_tokens": 8,
                                                       "kv_retention": pin(len(systems[k]))}
        else:
            question = f"A one-off question #{rng.randrange(10**6)}: what is {rng.choice(TOPICS)}?"
            yield "one-off", "/v1/completions", {"prompt": question, "max_tokens": 8}


def chats(n: int, model_dir: Path, model: str, seed: int = 7, max_tokens: int = 24) -> Iterator[Request]:
    """The real-model workload: chats with real questions; each system message's tokens (as the
    model's template renders them, counted with its tokenizer) pinned at priority 100."""
    from openai_api.chat import load_chat_template
    from openai_api.tokenizers import load_tokenizer

    template, tokenizer = load_chat_template(model_dir), load_tokenizer(model_dir)
    rng = random.Random(seed)
    systems = _policies(rng)
    pinned = [len(tokenizer.encode(template.render([{"role": "system", "content": s}], add_generation_prompt=False),
                                   add_special_tokens=False)) for s in systems]
    sessions: list[tuple[int, list[dict[str, str]]]] = []
    questions = iter(QUESTIONS * (n // len(QUESTIONS) + 1))
    for i in range(n):
        r = rng.random()
        common = {"model": model, "max_completion_tokens": max_tokens, "temperature": 0}
        if i % 4 == 3:  # a quarter: one-off questions, with the template's own default system prompt
            yield "one-off", "/v1/chat/completions", {**common, "messages": [
                {"role": "user", "content": next(questions)}]}
        elif r < 0.45 and sessions:
            j = rng.randrange(len(sessions))
            k, history = sessions[j]
            history = [*history, {"role": "assistant", "content": "It depends on the case."},
                       {"role": "user", "content": f"And what about {rng.choice(TOPICS)}?"}]
            sessions[j] = (k, history)
            yield "conversation", "/v1/chat/completions", {
                **common, "messages": [{"role": "system", "content": systems[k]}, *history],
                "kv_retention": pin(pinned[k])}
        else:
            k = rng.randrange(len(systems))
            history = [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}]
            sessions.append((k, history))
            yield "system prompt", "/v1/chat/completions", {
                **common, "messages": [{"role": "system", "content": systems[k]}, *history],
                "kv_retention": pin(pinned[k])}


def pin(tokens: int) -> dict[str, Any]:
    """Retention for a request whose first ``tokens`` tokens are the system prompt: priority 100."""
    return {"token_ranges": [{"start": 0, "end": tokens, "priority": 100}]}


async def send(client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any], res: DemoResult,
               clock: Callable[[], float] = time.perf_counter) -> None:
    """One request, streamed: its time to first token, usage, node and (for a chat) its answer."""
    t0 = clock()
    ttft: float | None = None
    # The first chunk that carries a token (its text may still be empty: bytes of a character to
    # come); a chat's stream opens with a chunk of the role alone, before any token.
    before_first = 1 if "messages" in body else 0
    text: list[str] = []
    usage: dict[str, Any] | None = None
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=stream_body) as r:
        res.requests += 1
        if r.status_code != 200:
            res.failed += 1
            res.errors[f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"] += 1
            return
        node = r.headers["x-kvflow-node"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if before_first:
                    before_first -= 1
                elif ttft is None:
                    ttft = clock() - t0
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    if usage is None:
        res.failed += 1
        res.errors["a stream without usage"] += 1
        return
    res.record(kind, node, usage, ttft)
    if kind == "one-off" and "messages" in body:
        res.answers.append((body["messages"][-1]["content"], "".join(text).strip()))
