"""The chat template of each model, as the nodes serving it advertise it (``GET /v1/chat/template``).

The router routes a chat by the prompt the node will compute: the messages rendered through the
node's chat template (``openai_api.chat``), tokenized and hashed as text. A node's template comes
with a ``version`` (a digest of the template and its special tokens); the router fetches it once
from a live node of the model and keeps it while that node instance lives, at most ``ttl_s``
(``KVFLOW_ROUTER_CHAT_TEMPLATE_TTL_S``), so a fleet that rolls out a new template is seen within it.

Engines behind a bridge (vLLM, SGLang, TensorRT-LLM) serve no such endpoint: for them the router
renders with the template of its own model folder (``KVFLOW_ROUTER_TOKENIZER_DIR``, the folder
whose ``tokenizer.json`` it tokenizes with: its ``chat_template.jinja`` or
``tokenizer_config.json``), the one the engine loaded from the same model. When neither is there,
a chat is routed by load alone (no prefix credit) rather than refused: the node renders the chat
itself, so the answer is the same, only the cache is not used for the choice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from openai_api.chat import ChatTemplate

log = logging.getLogger("kvflow.router")

#: How long one fetch of a template may take.
FETCH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Fetched:
    template: ChatTemplate
    node_id: str
    instance_id: str
    at: float  # time.monotonic() of the fetch


class ChatTemplates:
    """Per model, the template last fetched and the node instance it came from."""

    def __init__(self, client: httpx.AsyncClient, ttl_s: float = 60.0, fallback: ChatTemplate | None = None) -> None:
        self.client = client
        self.ttl_s = ttl_s
        #: the router's own model folder's template, for models whose nodes serve none
        self.fallback = fallback
        self.fetches = 0
        self.failures = 0
        self._by_model: dict[str, Fetched] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, model: str, rows: Sequence[Any]) -> ChatTemplate | None:
        """The template of ``model``, fetched from a live node among ``rows`` (``nodes`` rows) when
        the one held is older than ``ttl_s`` or its node instance is no longer live; None when no
        node of the model answers."""
        held = self._by_model.get(model)
        if held is not None and self._valid(held, rows):
            return held.template
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:  # one fetch per model at a time; the others take its result
            held = self._by_model.get(model)
            if held is not None and self._valid(held, rows):
                return held.template
            fetched = await self._fetch(model, rows)
            if fetched is None:  # the last one known beats the folder's, which beats none
                return held.template if held is not None else self.fallback
            if held is not None and held.template.version != fetched.template.version:
                log.info("model %s: chat template %s -> %s (from %s)", model, held.template.version,
                         fetched.template.version, fetched.node_id)
            self._by_model[model] = fetched
            return fetched.template

    def _valid(self, held: Fetched, rows: Sequence[Any]) -> bool:
        if time.monotonic() - held.at > self.ttl_s:
            return False
        return any(r["node_id"] == held.node_id and r["instance_id"] == held.instance_id and r["status"] == "live"
                   for r in rows)

    async def _fetch(self, model: str, rows: Sequence[Any]) -> Fetched | None:
        for r in rows:
            if r["model"] != model or r["status"] != "live" or not r["url"]:
                continue
            self.fetches += 1
            try:
                resp = await self.client.get(f"{r['url'].rstrip('/')}/v1/chat/template", timeout=FETCH_TIMEOUT_S)
                resp.raise_for_status()
                body = resp.json()
                if body.get("model") != model:
                    raise ValueError(f"the node serves {body.get('model')!r}")
                template = ChatTemplate.from_json(body)
            except (httpx.HTTPError, ValueError) as exc:
                self.failures += 1
                log.warning("chat template of %s from node %s: %s: %s", model, r["node_id"], type(exc).__name__, exc)
                continue
            return Fetched(template, r["node_id"], r["instance_id"], time.monotonic())
        return None

    def describe(self) -> dict[str, Any]:
        """What ``/v1/stats`` shows: per model, the version held and where it came from."""
        return {"fetches": self.fetches, "failures": self.failures,
                "fallback": None if self.fallback is None else self.fallback.version,
                "models": {m: {"version": f.template.version, "node_id": f.node_id,
                               "age_s": round(time.monotonic() - f.at, 3)} for m, f in self._by_model.items()}}
