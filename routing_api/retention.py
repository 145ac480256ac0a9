"""Fleet retention rules and tenant limits: the operator's side of retention (docs/prompt-caching.md).

**Rules** give retention to requests that carry none of their own (no ``kv_retention``, no
prompt-caching marks): the first rule whose ``match`` fits (model, tenant, tools present, prompt
length in tokens) splits the prompt by message role and gives each part its level:

* ``system``: the leading system/developer messages (and the tools, where the template renders
  them there), up to the end of the last of them as rendered;
* ``history``: what follows, up to the end of the message before the last user message (the
  earlier turns of a conversation);
* ``rest``: the rest of the prompt (the new turn; all of a completion's prompt);
* ``decode``: the generated tokens.

Each boundary is found as a breakpoint's is (``openai_api.prompt_cache.prefix_tokens``) and
rounded down to whole blocks. The preset ``seed`` is the seed's table: system prompt 100 for an
hour, multi-turn history 50 for 30 s, decode 30 for 10 s, the rest (one-off prompts) 0. Rules are
off unless configured (``KVFLOW_ROUTER_RETENTION_RULES``: ``seed`` or a JSON file), so existing
deployments do not change.

**Tenant limits** hold for every request of a tenant (its API key's), whatever set its retention
(its own ``kv_retention``, its marks or a rule): a priority above the tenant's ``max_priority`` is
lowered to it, and the blocks its retained ranges (priority above the default) would add on the
chosen node beyond ``max_retained_share`` of that node's blocks are cut off the retention (the
prompt's earliest blocks keep it). The router counts each tenant's retained blocks per node from
what it sends (block hashes until their retention expires): each router process counts its own.
A lowered retention is reported, never applied silently.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from eventbus.protocol import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from openai_api.chat import ChatTemplate, ChatTemplateError
from openai_api.prompt_cache import MarkedChat, prefix_tokens, system_end


class Level(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: StrictInt = Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)
    duration_s: float | None = Field(default=None, ge=0, description="Seconds at this priority; null: for good.")


class Match(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    tenant: str | None = None
    tools: bool | None = Field(default=None, description="true: only chats with tools; false: only without.")
    min_prompt_tokens: int = Field(default=0, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=0)

    def fits(self, model: str | None, tenant: str | None, tools: bool, prompt_tokens: int) -> bool:
        return ((self.model is None or self.model == model) and (self.tenant is None or self.tenant == tenant)
                and (self.tools is None or self.tools == tools) and prompt_tokens >= self.min_prompt_tokens
                and (self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens))


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    match: Match = Field(default_factory=Match)
    system: Level | None = None
    history: Level | None = None
    rest: Level | None = None
    decode: Level | None = None


class TenantLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_priority: StrictInt = Field(default=MAX_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    max_retained_share: float = Field(default=1.0, ge=0, le=1,
                                      description="Of a node's blocks, the most the tenant's retained ones may hold.")


class RetentionPolicy(BaseModel):
    """The rules (first match wins) and the tenants' limits (``default_limit`` for the others)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: tuple[Rule, ...] = ()
    tenants: dict[str, TenantLimit] = Field(default_factory=dict)
    default_limit: TenantLimit = Field(default_factory=TenantLimit)

    def rule_for(self, model: str | None, tenant: str | None, tools: bool, prompt_tokens: int) -> Rule | None:
        return next((r for r in self.rules if r.match.fits(model, tenant, tools, prompt_tokens)), None)

    def limit_for(self, tenant: str | None) -> TenantLimit:
        return self.tenants.get(tenant or "", self.default_limit)

    @property
    def limits_anything(self) -> bool:
        return bool(self.tenants) or self.default_limit != TenantLimit()


SEED = Rule(name="seed", system=Level(priority=100, duration_s=3600.0), history=Level(priority=50, duration_s=30.0),
            rest=Level(priority=0), decode=Level(priority=30, duration_s=10.0))
"""The seed's table: system prompt 100 for an hour, history 50 for 30 s, decode 30 for 10 s, one-off 0."""


def load_policy(spec: str | None) -> RetentionPolicy:
    """``None``/"": no rules, no limits; ``seed``: the seed's table for every request; else a JSON
    file holding a :class:`RetentionPolicy` (``rules`` may name ``"seed"`` for the preset).

    Raises:
        ValueError: a file that is not a valid policy (pydantic's message names the field).
    """
    if not spec:
        return RetentionPolicy()
    if spec == "seed":
        return RetentionPolicy(rules=(SEED,))
    raw: Any = json.loads(Path(spec).read_text())
    if isinstance(raw, dict) and isinstance(raw.get("rules"), list):
        raw["rules"] = [SEED.model_dump() if r == "seed" else r for r in raw["rules"]]
    return RetentionPolicy.model_validate(raw)


@dataclass
class Retention:
    """A request's retention as the router will send it, and where it came from."""

    #: "kv_retention" (the body's), "prompt_cache" (its marks), "rule"
    source: str
    body: dict[str, Any]  # the ``kv_retention`` object (``openai_api.schemas.RetentionIn``'s shape)
    rule: str | None = None
    lowered: list[str] = field(default_factory=list)

    @property
    def in_body(self) -> bool:
        """Whether the router sends it as the body's ``kv_retention``: it differs from what the node
        would make of the body (a rule gave it, or a limit lowered it)."""
        return self.source == "rule" or bool(self.lowered)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "rule": self.rule, "lowered": self.lowered, "kv_retention": self.body}


def _level(lv: Level | None, start: int, end: int | None) -> list[dict[str, Any]]:
    if lv is None or (end is not None and end <= start):
        return []
    return [{"start": start, "end": end, "priority": lv.priority, "duration_s": lv.duration_s}]


def rule_retention(rule: Rule, chat: MarkedChat | None, template: ChatTemplate | None,
                   encode: Callable[[str], Sequence[int]], prompt: Sequence[int], block_size: int) -> dict[str, Any]:
    """The ``kv_retention`` a rule gives a prompt (``chat`` None: a completion, all of it ``rest``)."""
    bounds = [0, 0]
    if chat is not None and template is not None:
        messages = chat.messages
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages))
        n_system = system_end(chat)
        try:
            if n_system:
                bounds[0] = prefix_tokens(template, encode, chat, n_system - 1, None, prompt)
            bounds[1] = bounds[0]
            if last_user > n_system:
                bounds[1] = prefix_tokens(template, encode, chat, last_user - 1, None, prompt)
        except ChatTemplateError:
            bounds = [0, 0]  # a template that refuses the cut chat: the whole prompt is the rest
    s, h = ((b // block_size) * block_size for b in bounds)
    ranges = _level(rule.system, 0, s) + _level(rule.history, s, h) + _level(rule.rest, h, None)
    out: dict[str, Any] = {"token_ranges": ranges}
    if rule.decode is not None:
        out |= {"decode_priority": rule.decode.priority, "decode_duration_s": rule.decode.duration_s}
    return out


def cap_priority(r: Retention, limit: TenantLimit, tenant: str | None) -> None:
    """Lower every priority above the tenant's ``max_priority`` to it (reported in ``r.lowered``)."""
    top = limit.max_priority
    over = [t for t in r.body.get("token_ranges", []) if t["priority"] > top]
    for t in over:
        t["priority"] = top
    if r.body.get("decode_priority", DEFAULT_PRIORITY) > top:
        r.body["decode_priority"] = top
        over.append({})
    if over:
        r.lowered.append(f"priority capped at {top}, tenant {tenant or '(none)'}'s max_priority")


class RetainedLedger:
    """Each tenant's retained blocks per node, as this router sent them: hash → when it expires."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._held: dict[tuple[str, str], dict[bytes, float]] = {}

    def held(self, tenant: str, node: str) -> int:
        now = self.clock()
        blocks = self._held.get((tenant, node), {})
        for h in [h for h, until in blocks.items() if until <= now]:
            del blocks[h]
        return len(blocks)

    def admit(self, r: Retention, limit: TenantLimit, tenant: str | None, node: str, capacity: int,
              hashes: bytes, block_size: int) -> None:
        """Count the request's retained blocks on ``node``; cut its retention where they would
        pass ``max_retained_share`` of the node's ``capacity`` blocks (reported in ``r.lowered``).

        ``hashes``: the prompt's full blocks' hashes at ``block_size``, 8 bytes each.
        """
        key = (tenant or "", node)
        blocks = self._held.setdefault(key, {})
        room = int(limit.max_retained_share * capacity) - self.held(*key)
        now = self.clock()
        kept = []
        for t in r.body.get("token_ranges", []):
            if t["priority"] <= DEFAULT_PRIORITY:
                kept.append(t)
                continue
            first, last = t["start"] // block_size, len(hashes) // 8 if t["end"] is None else t["end"] // block_size
            new = [hashes[8 * i:8 * i + 8] for i in range(first, last) if hashes[8 * i:8 * i + 8] not in blocks]
            take = min(len(new), max(room, 0))
            ttl = float("inf") if t["duration_s"] is None else float(t["duration_s"])
            for h in new[:take]:
                blocks[h] = now + ttl
            room -= take
            if take < len(new):  # cut at the first block over the share: the earliest keep it
                cut = next(i for i in range(first, last) if hashes[8 * i:8 * i + 8] == new[take])
                if cut > first:
                    kept.append({**t, "end": cut * block_size})
                r.lowered.append(f"retained blocks of tenant {tenant or '(none)'} on {node} capped at "
                                 f"{limit.max_retained_share:.0%} of its {capacity} blocks: tokens from "
                                 f"{cut * block_size} keep the default priority")
            else:
                kept.append(t)
        if "token_ranges" in r.body:
            r.body["token_ranges"] = kept
