"""What one router process holds: its connections, its own view of the fleet, its counters.

:class:`RouterState` lives on ``app.state`` (set in the app's lifespan, read through
``routing_api.deps``). Its in-flight counts, suspicion marks and recent decisions are this process's
own: with ``--workers N`` each process has its own (docs/router.md, "Running it").
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from eventbus.protocol import NodeId
from openai_api.chat import load_chat_template
from openai_api.tokenizers import Tokenizer, load_tokenizer
from routing_api.cache_keys import CacheKeys
from routing_api.config import ApiKey, RouterSettings
from routing_api.fleet import FleetView, fleet_view
from routing_api.hubs import Hubs
from routing_api.prefill import PrefillQueue, TtftTail
from routing_api.queries import StateReader
from routing_api.replica import ReplicaMetrics, ReplicaMonitor, primary_reader
from routing_api.retention import RetainedLedger, RetentionPolicy, load_policy
from routing_api.scoring import Decision, Finished, RoutedWork, RoutingWeights
from routing_api.templates import ChatTemplates
from state_store.config import DatabaseSettings

#: How long the router waits to connect to a node (the whole request: ``upstream_timeout_s``).
CONNECT_TIMEOUT_S = 5.0
#: How long a finished request is remembered, to take its load off heartbeats taken before it
#: ended (a node's heartbeat interval is at most 2 s; its way to PostgreSQL adds a little).
FINISHED_KEEP_S = 5.0


@dataclass
class Inflight:
    """The requests this router proxied to a node and has not seen finish, and their prompt blocks
    (in the node's block size, as its heartbeat's ``active_blocks``)."""

    requests: int = 0
    blocks: int = 0


class Metrics:
    """The router's Prometheus metrics (``/metrics``), in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("kvflow_router_decisions_total", "Routing decisions", ["node"], registry=r)
        self.decision_seconds = Histogram(
            "kvflow_router_decision_seconds", "Time to decide (tokenize, hash, query, score)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r)
        self.matched_blocks = Counter("kvflow_router_matched_blocks_total", "Prompt blocks cached on the choice",
                                      registry=r)
        self.prompt_blocks = Counter("kvflow_router_prompt_blocks_total", "Prompt blocks routed", registry=r)
        self.proxied = Counter("kvflow_router_proxied_total", "Completions proxied", ["node", "outcome"], registry=r)
        self.inflight = Gauge("kvflow_router_inflight_requests", "Proxied requests not finished", ["node"],
                              registry=r)
        self.tail_guard = Counter("kvflow_router_tail_guard_total", "Requests the tail guard sent elsewhere than "
                                  "the cost's choice (routing_api.prefill)", registry=r)
        self.hub_stay = Counter("kvflow_router_hub_stay_total", "Requests kept on an idle over-bound node holding "
                                "their own context (routing_api.hubs)", registry=r)
        self.warmups = Counter("kvflow_router_warmups_total", "Hub copies sent to a node (routing_api.hubs)",
                               ["node", "outcome"], registry=r)
        self.bound_gate = Counter("kvflow_router_bound_gate_total", "Requests the bound gate or the queue "
                                  "tiebreak sent elsewhere than the bounded choice (routing_api.prefill)", registry=r)
        self.degraded = Counter("kvflow_router_degraded_decisions", "Decisions made without PostgreSQL "
                                "(the last known fleet, by load alone)", registry=r)
        self.replica = ReplicaMetrics(r)

    def record_decision(self, decision: Decision, prompt_blocks: int, elapsed_s: float) -> None:
        """Count one decision: its time, the prompt's blocks, and the choice with its cached blocks
        (both in the chosen node's block size)."""
        self.decision_seconds.observe(elapsed_s)
        self.prompt_blocks.inc(prompt_blocks)
        if decision.chosen is not None:
            self.decisions.labels(decision.chosen.node_id).inc()
            self.matched_blocks.inc(decision.chosen.matched_blocks)


class FleetCache:
    """The :class:`FleetView` of each model for the latest read of the ``nodes`` table.

    ``block_size``: ``KVFLOW_ROUTER_BLOCK_SIZE`` (only nodes of that size are candidates), or None
    (every size, the costs in the fleet's).

    ``StateReader.nodes`` returns the same list until it reads the table again, so a new list
    object means a new read: the views derived from the old one are dropped. The list is held
    (not just its ``id``), so a new list can never be mistaken for the old one.
    """

    def __init__(self, block_size: int | None) -> None:
        self.block_size = block_size
        self._views: dict[str | None, FleetView] = {}
        self._rows: Sequence[Any] = []

    def view(self, rows: Sequence[Any], model: str | None) -> FleetView:
        """The fleet as a request for ``model`` sees it, derived from ``rows`` once."""
        if self._rows is not rows:  # the reader has read the nodes table again
            self._views.clear()
            self._rows = rows
        fv = self._views.get(model)
        if fv is None:
            fv = self._views[model] = fleet_view(rows, model, self.block_size)
        return fv


@dataclass
class RouterState:
    """One router process's state: settings, connections, and what only this process knows."""

    settings: RouterSettings
    reader: StateReader
    tokenizer: Tokenizer
    weights: RoutingWeights
    keys: dict[str, ApiKey]
    client: httpx.AsyncClient
    #: the chat template of each model (None: made from ``client`` and the settings)
    templates: ChatTemplates = None  # type: ignore[assignment]
    metrics: Metrics = field(default_factory=Metrics)
    fleet: FleetCache = field(default_factory=lambda: FleetCache(None))
    inflight: dict[NodeId, Inflight] = field(default_factory=lambda: collections.defaultdict(Inflight))
    #: per node, the proxied requests that finished within ``FINISHED_KEEP_S``, oldest first
    finished: dict[NodeId, collections.deque[Finished]] = field(default_factory=dict)
    suspect_until: dict[NodeId, float] = field(default_factory=dict)
    #: per node, the prefill work (uncached prompt blocks) proxied to it, decayed (``time.monotonic()``)
    work: dict[NodeId, RoutedWork] = field(default_factory=dict)
    #: per node, the prefills proxied to it and not answered yet (the tail guard, ``routing_api.prefill``)
    prefill: dict[NodeId, PrefillQueue] = field(default_factory=dict)
    #: the tail of predicted TTFTs (its quantile: ``weights.ttft_quantile``)
    tail: TtftTail = field(init=False)
    #: the continuations of the blocks routed lately (``routing_api.hubs``; fanout ``weights.hub_fanout``)
    hubs: Hubs = field(init=False)
    #: the hub copies being sent (``routing_api.warmups``): kept until they finish
    warming: set[asyncio.Task[None]] = field(default_factory=set)
    recent: collections.deque[dict[str, Any]] = field(default_factory=collections.deque)
    decisions: int = 0
    proxied: int = 0
    upstream_errors: int = 0
    started: float = field(default_factory=time.time)
    rng: random.Random = field(default_factory=random.Random)
    #: the standby's lag and the reader to use (None: replica_check_s = 0)
    replication: ReplicaMonitor | None = None
    #: the operator's retention rules and tenant limits (``retention_rules``)
    policy: RetentionPolicy = field(default_factory=RetentionPolicy)
    #: each tenant's retained blocks per node, as this process sent them
    ledger: RetainedLedger = field(default_factory=RetainedLedger)
    #: the ``prompt_cache_key`` rows (None: made from ``reader``)
    cache_keys: CacheKeys = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.tail = TtftTail(self.weights.ttft_quantile)
        self.hubs = Hubs(self.weights.hub_fanout)
        if self.cache_keys is None:
            self.cache_keys = CacheKeys(self.reader)
        self._keys = itertools.count()
        if self.templates is None:
            folder = self.settings.tokenizer_dir
            self.templates = ChatTemplates(self.client, self.settings.chat_template_ttl_s,
                                           load_chat_template(folder) if folder else None)

    @classmethod
    def open(cls, settings: RouterSettings, keys: dict[str, ApiKey], database_url: str, db: DatabaseSettings,
             metrics: Metrics) -> RouterState:
        """The state of a starting process: an HTTP client for the nodes, a reader, the tokenizer.

        Args:
            settings: the router's settings.
            keys: the API keys (none: open).
            database_url: the reader role's URL.
            db: the database settings (pool size, statement timeout).
            metrics: the app's metrics (they outlive a restart of the lifespan).
        """
        s = settings
        node_headers = {"authorization": f"Bearer {s.node_api_key.get_secret_value()}"} if s.node_api_key else {}
        client = httpx.AsyncClient(timeout=httpx.Timeout(s.upstream_timeout_s, connect=CONNECT_TIMEOUT_S),
                                   headers=node_headers,
                                   limits=httpx.Limits(max_connections=512, max_keepalive_connections=128))
        reader = StateReader(database_url, s.nodes_cache_s, pool_size=db.pool_size,
                             statement_timeout_ms=db.statement_timeout_ms)
        monitor = None
        if s.replica_check_s > 0:
            primary = primary_reader(s.primary_reader_url.get_secret_value() if s.primary_reader_url else None, reader)
            monitor = ReplicaMonitor(reader, primary, s.replica_max_lag_s, metrics.replica)
        return cls(s, reader, load_tokenizer(s.tokenizer_dir), s.weights(), keys, client, metrics=metrics,
                   fleet=FleetCache(s.block_size), recent=collections.deque(maxlen=s.recent_decisions),
                   replication=monitor, policy=load_policy(s.retention_rules))

    def use_reader(self, reader: StateReader) -> None:
        """Read from ``reader`` from now on (the standby, or the primary while the standby lags)."""
        self.reader = reader
        self.cache_keys.reader = reader

    async def close(self) -> None:
        """Close the HTTP client (hub copies still being sent are cancelled), then the database connections."""
        await self.cache_keys.drain()
        for task in list(self.warming):
            task.cancel()
        await asyncio.gather(*self.warming, return_exceptions=True)
        await self.client.aclose()
        if self.replication is not None:
            await self.replication.replica.close()
            await self.replication.close()
        else:
            await self.reader.close()

    def record_decision(self, decision: Decision, prompt_blocks: int, prompt_tokens: int, matched_tokens: int,
                        elapsed_s: float) -> dict[str, Any]:
        """Count a decision (here and in the metrics) and keep it among the recent ones (returned:
        the proxy adds what it did to the request's retention)."""
        self.decisions += 1
        self.metrics.record_decision(decision, prompt_blocks, elapsed_s)
        entry = {"ts": time.time(), "node_id": decision.chosen.node_id if decision.chosen else None,
                 "prompt_tokens": prompt_tokens, "matched_tokens": matched_tokens, "reason": decision.reason}
        self.recent.appendleft(entry)
        return entry

    def start_proxy(self, node: NodeId, blocks: int, work: int = 0, block_size: int = 0) -> Proxied:
        """Count a request proxied to ``node`` with ``blocks`` prompt blocks as in flight, and
        ``work`` of them not cached there as prefill work routed to it (``RoutedWork``) and as a
        prefill queued on it (:class:`~routing_api.prefill.PrefillQueue`, at ``block_size`` tokens
        a block; 0: ``block_size`` of the settings, else 16).

        ``blocks`` are in the node's block size (``Candidate.prompt_blocks``), as its heartbeat
        counts its load and as :func:`routing_api.scoring.decide` converts it; so is the
        ``Finished`` record the request leaves.

        Returns:
            the request's :class:`Proxied`: ``first_token()`` when its answer begins, and
            ``done(outcome, ran=True)`` once when it has finished: ``"ok"``, ``"client_error"``
            (the node answered 4xx) or ``"upstream_error"`` (the node failed: it is then avoided for
            ``suspect_s``). ``ran=False``: it never reached the node (its connection was refused);
            otherwise the request is remembered as finished (``finished``: a heartbeat taken while
            it ran no longer counts its load).
        """
        inf = self.inflight[node]
        inf.requests += 1
        inf.blocks += blocks
        self.metrics.inflight.labels(node).set(inf.requests)
        self.proxied += 1
        self.add_work(node, work)
        queue = self.prefill.get(node)
        if queue is None:
            size = block_size or self.settings.block_size or 16
            queue = self.prefill[node] = PrefillQueue(size / self.settings.prefill_tokens_per_s)
        return Proxied(self, node, blocks, work, queue, next(self._keys))

    def add_work(self, node: NodeId, blocks: int) -> None:
        """Add ``blocks`` of prefill work to ``node``'s (negative: take a refused request's back off)."""
        if blocks:
            tau, now = self.weights.work_tau_s, time.monotonic()
            self.work[node] = RoutedWork(max(0.0, self.work.get(node, RoutedWork(0.0, now)).at(now, tau) + blocks), now)

    def record_finished(self, node: NodeId, f: Finished) -> None:
        """Remember a finished request of ``node``; forget those that ended over ``FINISHED_KEEP_S`` ago."""
        ended = self.finished.get(node)
        if ended is None:
            ended = self.finished[node] = collections.deque()
        ended.append(f)
        horizon = f.ended - FINISHED_KEEP_S
        while ended[0].ended < horizon:
            ended.popleft()

    def router_inflight(self, node_id: NodeId) -> int:
        """How many requests this process has proxied to the node and not seen finish."""
        inf = self.inflight.get(node_id)
        return inf.requests if inf is not None else 0

    def is_suspect(self, node_id: NodeId) -> bool:
        """Whether the node failed a proxied request less than ``suspect_s`` ago."""
        return self.suspect_until.get(node_id, 0) > time.monotonic()


class Proxied:
    """One proxied request's accounting in the router's state (:meth:`RouterState.start_proxy`)."""

    def __init__(self, state: RouterState, node: NodeId, blocks: int, work: int, queue: PrefillQueue,
                 key: int) -> None:
        self.state, self.node, self.blocks, self.work, self.queue, self.key = state, node, blocks, work, queue, key
        self.started = time.time()
        self.answered = False
        queue.add(key, work, time.monotonic())

    def first_token(self) -> None:
        """Its answer began (a stream's first chunk): its prefill is done."""
        if not self.answered:
            self.answered = True
            self.queue.first_token(self.key, time.monotonic())

    def __call__(self, outcome: str, ran: bool = True) -> None:
        """It has finished (see :meth:`RouterState.start_proxy`). Not answered before, it leaves
        its node's prefill queue: a whole answer (not streamed) as done, without measuring the
        node's rate (its time includes the decoding); a 4xx or a failure as never prefilled."""
        state, node = self.state, self.node
        if not self.answered:
            self.answered = True
            if ran and outcome == "ok":
                self.queue.first_token(self.key, time.monotonic(), learn=False)
            else:
                self.queue.cancel(self.key)
        inf = state.inflight[node]
        inf.requests -= 1
        inf.blocks -= self.blocks
        state.metrics.inflight.labels(node).set(inf.requests)
        state.metrics.proxied.labels(node, outcome).inc()
        if outcome == "upstream_error":
            state.upstream_errors += 1
            state.suspect_until[node] = time.monotonic() + state.settings.suspect_s
        if not ran:
            state.add_work(node, -self.work)
        if ran and state.settings.account_finished:
            state.record_finished(node, Finished(self.started, time.time(), self.blocks))
