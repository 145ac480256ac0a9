"""``kvflow bridge``: one process per engine instance, from its KV events to kvflow's Kafka topics.

A :class:`Bridge` is, to the rest of kvflow, a node: it publishes ``EventBatch``es (from a
:class:`~bridge.translate.Translator`, through the node's own ``Publisher``) and ``NodeStats``
heartbeats under ``--node-id``, answers the materializer's resync requests with a snapshot of what
it holds, and says goodbye when it stops. So the materializer, the SQL history, the dashboard and
the router work unchanged for vLLM, SGLang and TensorRT-LLM.

**Sequence numbers** (vLLM, SGLang: one per batch, from 0 at each publisher start):

* at start, and at the first batch seen if that is seq S > 0 (the bridge attached late): the
  replay socket is asked from 0; if it still holds every batch from 0, the history is whole and
  the view **exact**; otherwise the batches it has are applied and the view is **partial** (a
  subset of the engine's blocks); a live batch that the replay gave already (same seq and time)
  is dropped;
* a skipped seq: fetched from the replay socket (duplicates dropped by seq); if it cannot be
  filled, a removal may have been missed, so the instance is dropped and a **new instance**
  starts (new ``instance_id``, ``created``): partial, never wrong;
* a seq that drops back: the engine restarted with an empty cache: a new instance, exact;
* ``AllBlocksCleared``: a new instance, exact.

A partial view never credits a block the engine may not hold; it only lacks blocks stored before
the loss, until they are evicted or stored again. ``--reset-engine-cache`` (opt-in) makes it exact
at once: the bridge asks the engine to empty its prefix cache (vLLM ``POST /reset_prefix_cache``,
SGLang ``POST /flush_cache``), and the ``AllBlocksCleared`` that follows starts an exact instance.

**Heartbeats** come from the engine's Prometheus metrics (``bridge.engine_http``) every
``heartbeat_s``; when the engine's metrics stop answering, no heartbeat goes out and the node goes
stale, as a kvflow node does.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from bridge.engine_http import EngineClient, EngineLoad
from bridge.translate import BridgeStats, Translator, level_of
from bridge.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineBatch
from bridge.zmq_source import ZmqSource
from eventbus.hashing import block_digest
from eventbus.protocol import GPU, MAX_PRIORITY, MIN_PRIORITY, InstanceId, NodeCounters, NodeId, NodeStats
from eventbus.publisher import ControlListener, Publisher, Sink

log = logging.getLogger("kvflow.bridge")

#: How many applied batches are remembered (seq → ts) to drop live duplicates of replayed ones.
SEEN_BATCHES = 4096


class BridgeSettings(BaseSettings):
    """``KVFLOW_BRIDGE_…`` (the ``kvflow bridge`` flags override them)."""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_BRIDGE_", extra="ignore", protected_namespaces=())

    engine: Literal["vllm", "sglang", "trtllm"] = Field(default="vllm", description="The engine's kind.")
    node_id: NodeId = Field(default=NodeId("engine-a"), description="The node's name in kvflow (the Kafka key).")
    events: str | None = Field(default=None, description="The engine's ZMQ PUB endpoint, e.g. tcp://host:5557.")
    replay: str | None = Field(default=None, description="Its replay (ROUTER) endpoint, e.g. tcp://host:5558.")
    topic: str = Field(default="", description="The publisher's topic.")
    engine_url: str = Field(default="http://127.0.0.1:8000", description="The engine's OpenAI server (the "
                                                                         "router sends requests there).")
    metrics_url: str | None = Field(default=None, description="Its Prometheus page (default engine_url/metrics).")
    engine_api_key: SecretStr | None = Field(default=None, description="Bearer key of the engine's HTTP API.")
    model: str | None = Field(default=None, description="The served model's name (default: /v1/models).")
    block_size: int | None = Field(default=None, ge=1, description="Tokens per block (default: the metrics or "
                                                                   "the events).")
    num_blocks: int | None = Field(default=None, ge=1, description="GPU blocks (default: the metrics).")
    heartbeat_s: float = Field(default=1.0, gt=0, le=2.0, description="NodeStats interval.")
    replay_timeout_s: float = Field(default=2.0, gt=0, description="How long a replay may take.")
    reset_engine_cache: bool = Field(default=False, description="Empty the engine's prefix cache when the view "
                                                                "is partial, to make it exact.")
    max_keys: int = Field(default=1 << 22, ge=1, description="Engine blocks held at most (beyond: a new instance).")
    poll_s: float = Field(default=0.2, gt=0, description="TensorRT-LLM: how often its events are fetched.")
    vllm_plugin: bool = Field(default=False, description=(
        "vLLM runs kvflow's retention plugin (docs/vllm-retention.md): heartbeats say vllm+kvflow from the "
        "start (else once its events carry priorities)."))


def lora_id_of(event: BlockStored) -> int | None:
    """The LoRA id a stored block is hashed with: the event's ``lora_id``, else one derived from its
    ``lora_name`` (the first 63 bits of a digest of the name; docs/bridges.md)."""
    if event.lora_id is not None:
        return event.lora_id
    if event.lora_name:
        return int.from_bytes(block_digest(None, event.lora_name.encode())[:8], "big") >> 1
    return None


@dataclass(frozen=True, slots=True)
class View:
    """What the heartbeat thread reads of the main loop's state (replaced whole, never mutated)."""

    instance_id: InstanceId
    last_event_id: int
    gpu_blocks: int
    host_blocks: int
    block_size: int | None


class Bridge:
    """One engine instance's events and load, published as a kvflow node (see the module docstring)."""

    def __init__(self, settings: BridgeSettings, sink: Sink, engine: EngineClient, source: ZmqSource | None = None,
                 control: ControlListener | None = None, clock: Callable[[], float] = time.time,
                 load: EngineLoad | None = None) -> None:
        self.s = settings
        self.sink = sink
        self.engine = engine
        self.source = source
        self.control = control
        self.clock = clock
        self.stats = BridgeStats()
        self.instances = 0
        self.resets: dict[str, int] = {}
        self.engine_resets = 0
        self.expected: int | None = None
        self.block_size = settings.block_size
        self.load = load  # the first scrape, for the first instance's capacity
        self.model = settings.model
        #: the engine's stored-block events carry priorities (vLLM with kvflow's plugin)
        self.plugin_seen = False
        #: TensorRT-LLM's way (no ZMQ source): fetch events, return how many came
        self.poll_events: Callable[[], int] | None = None
        self.translator: Translator | None = None
        self.publisher: Publisher | None = None
        self._reset_asked = False
        #: seq → ts of the batches applied lately: a live batch also replayed is dropped, not a restart
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self.new_instance(partial=False)
        self._heartbeat = threading.Thread(target=self._beat_loop, name=f"bridge-heartbeat-{settings.node_id}",
                                           daemon=True)

    # ------------------------------------------------------------------ instances

    @property
    def capacity(self) -> int:
        if self.s.num_blocks:
            return self.s.num_blocks
        return self.load.num_gpu_blocks if self.load and self.load.num_gpu_blocks else 0

    def new_instance(self, *, partial: bool, reason: str = "") -> None:
        """Start a new kvflow instance (the old one's queued events go out first)."""
        if self.publisher is not None:
            self.publisher.pump()
            self.resets[reason] = self.resets.get(reason, 0) + 1
            log.warning("node %s: a new instance (%s)%s", self.s.node_id, reason, ", partial" if partial else "")
        self.instance_id = InstanceId(uuid.uuid4().hex)
        # The engine holds at most its capacity of distinct hashes: more means removals were missed.
        bound = min(self.s.max_keys, 2 * self.capacity) if self.capacity else self.s.max_keys
        self.translator = Translator(num_blocks=[self.capacity, 0], max_keys=bound, stats=self.stats,
                                     partial=partial)
        self.publisher = Publisher(self.translator, self.sink, self.s.node_id, self.instance_id)
        self.instances += 1
        self._reset_asked = False
        self.view = self._view()

    def _view(self) -> View:
        t = self.translator
        assert t is not None
        return View(self.instance_id, t.last_event_id, t.blocks_on(GPU), t.num_blocks - t.blocks_on(GPU),
                    self.block_size)

    @property
    def partial(self) -> bool:
        return self.translator is not None and self.translator.partial

    # ------------------------------------------------------------------ ZMQ batches

    def attach(self) -> None:
        """At start: everything the replay socket still holds, from seq 0 — an engine that has
        been running (and may be idle now) is known at once, exactly if seq 0 is still there."""
        if self.source is None or self.source.replay_url is None:
            return
        batches, _ = self.source.replay(0)
        by_seq = {b.seq: b for b in batches}
        if not by_seq:
            return  # a new engine, or no answer: the first live batch decides
        seq = min(by_seq)
        if seq > 0:
            self.translator.partial = True  # type: ignore[union-attr]
            log.warning("node %s: the replay holds seq %d on, not 0: partial view", self.s.node_id, seq)
        self.expected = self._apply_run(by_seq, seq)  # up to the first hole; a later live batch fetches the rest

    def reconnected(self) -> None:
        """The SUB connected again: the publisher went away and came back. What it published
        before the SUB reconnected comes from the replay socket: if its batches are not the ones
        applied (a seq seen with another time, or none as far as ``expected``), the engine
        restarted — a new, exact instance from its seq 0."""
        if self.source is None or self.expected is None:
            return
        batches, _ = self.source.replay(0)
        by_seq = {b.seq: b for b in batches}
        if not by_seq:
            return
        restarted = max(by_seq) < self.expected - 1 or any(
            seq in self._seen and self._seen[seq] != b.ts for seq, b in by_seq.items())
        start = 0 if restarted else self.expected
        if restarted:
            self.new_instance(partial=min(by_seq) > 0, reason="engine restarted")
            self._seen.clear()
        seq = self._apply_run(by_seq, start)
        self.expected = max(self.expected, seq) if not restarted else seq

    def on_batch(self, batch: EngineBatch) -> None:
        """One batch from the SUB socket, in the order it came (see the module docstring)."""
        seq = batch.seq
        if self._seen.get(seq) == batch.ts:
            return  # already applied (from a replay): not a restart
        if self.expected is None or seq < self.expected:
            if self.expected is not None:  # the publisher restarted: the engine's cache is empty
                self.new_instance(partial=False, reason="engine restarted")
            self.expected = 0
            if seq > 0:
                self._catch_up(0, seq, fresh=True)
        elif seq > self.expected:
            self._catch_up(self.expected, seq, fresh=False)
        self._apply(batch)
        self.expected = seq + 1

    def _catch_up(self, start: int, until: int, *, fresh: bool) -> None:
        """Fill seqs ``start … until-1`` from the replay socket; what cannot be filled is lost."""
        got: dict[int, EngineBatch] = {}
        if self.source is not None:
            batches, _ = self.source.replay(start)
            got = {b.seq: b for b in batches if start <= b.seq < until}
        suffix = []  # the replayed batches that run up to `until` without a hole
        for seq in range(until - 1, start - 1, -1):
            if seq not in got:
                break
            suffix.append(got[seq])
        suffix.reverse()
        if len(suffix) < until - start:  # a hole: what came before it may hide a removal
            lost = f"seq {start}..{until - len(suffix) - 1} lost"
            if fresh:
                self.translator.partial = True  # type: ignore[union-attr]  # attached late: nothing held yet
                log.warning("node %s: attached at seq %d; %s (replay holds no earlier batch): partial view",
                            self.s.node_id, until, lost)
            else:
                self.new_instance(partial=True, reason="gap not filled by replay")
        for b in suffix:
            self._apply(b)

    def _apply_run(self, by_seq: dict[int, EngineBatch], start: int) -> int:
        """Apply ``by_seq``'s batches from ``start`` up to the first missing seq; returns that seq."""
        seq = start
        while seq in by_seq:
            self._apply(by_seq[seq])
            seq += 1
        return seq

    def _apply(self, batch: EngineBatch) -> None:
        self.stats.batches += 1
        self._seen[batch.seq] = batch.ts
        if len(self._seen) > SEEN_BATCHES:
            del self._seen[next(iter(self._seen))]
        for name, n in batch.skipped.items():
            self.stats.skipped[name] = self.stats.skipped.get(name, 0) + n
        for ev in batch.events:
            t = self.translator
            assert t is not None
            if isinstance(ev, BlockStored):
                if self.block_size is None:
                    self.block_size = ev.block_size
                if ev.priorities is not None and not self.plugin_seen:
                    self.plugin_seen = True
                    log.info("node %s: the engine's events carry priorities: kvflow's retention plugin is active",
                             self.s.node_id)
                if ev.priority_update:  # blocks it holds, at new priorities: never new copies
                    for key, p in zip(ev.block_hashes, _priorities(ev) or (), strict=False):
                        t.updated(key, priority=p)
                    continue
                t.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, lora_id=lora_id_of(ev),
                         cache_salt=ev.cache_salt, level=level_of(ev.medium), priorities=_priorities(ev))
            elif isinstance(ev, BlockRemoved):
                t.removed(ev.block_hashes, level_of(ev.medium))
            elif isinstance(ev, AllBlocksCleared):
                self.new_instance(partial=False, reason="AllBlocksCleared")
            if self.translator is not None and self.translator.reset_reason:
                self.new_instance(partial=True, reason=self.translator.reset_reason)
        self.maybe_reset_engine()

    def maybe_reset_engine(self) -> None:
        if self.s.reset_engine_cache and self.partial and not self._reset_asked:
            self._reset_asked = True
            if self.engine.reset_cache():
                self.engine_resets += 1
                log.info("node %s: asked the engine to empty its prefix cache (the view was partial)",
                         self.s.node_id)

    # ------------------------------------------------------------------ the loops

    def step(self, timeout_s: float = 0.1) -> None:
        """One turn of the main loop: a batch (if one comes), resync requests, publishing."""
        if self.source is not None:
            batch = self.source.recv(timeout_s)
            if self.source.take_reconnect():
                self.reconnected()
            if batch is not None:
                self.on_batch(batch)
        elif self.poll_events is not None and not self.poll_events():
            self._stop.wait(self.s.poll_s)
        self.pump()

    def pump(self) -> None:
        if self.control is not None and self.control.take_resync():
            self.translator.request_snapshot()  # type: ignore[union-attr]
        self.publisher.pump()  # type: ignore[union-attr]
        self.view = self._view()

    @property
    def engine_name(self) -> str:
        """``NodeStats.engine``: the engine's kind; ``vllm+kvflow`` for vLLM with kvflow's plugin
        (declared, or seen: its stored-block events carry ``priorities``)."""
        if self.s.engine == "vllm" and (self.s.vllm_plugin or self.plugin_seen):
            return "vllm+kvflow"
        return self.s.engine

    def node_stats(self, load: EngineLoad, status: Literal["live", "stopping"] = "live") -> NodeStats | None:
        """The heartbeat for ``load`` (None while the block size is unknown)."""
        v = self.view
        size = v.block_size or load.block_size
        if size is None:
            return None
        capacity = self.capacity
        active = round(load.usage * capacity)
        return NodeStats(
            schema_version=1, node_id=self.s.node_id, instance_id=v.instance_id, url=self.s.engine_url,
            model=self.model or "", block_size=size, ts=self.clock(),
            capacity=[capacity, 0], used=[max(active, min(capacity, v.gpu_blocks)) if capacity else v.gpu_blocks,
                                          v.host_blocks],
            active_requests=load.running, queued_requests=load.waiting, last_event_id=v.last_event_id,
            active_blocks=active, status=status, engine=self.engine_name,
            counters=NodeCounters(events_published=self.publisher.events_sent if self.publisher else 0))

    def beat(self) -> bool:
        """Send one heartbeat from a fresh scrape; False when the engine did not answer."""
        load = self.engine.load()
        if load is None:
            return False
        self.load = load
        if self.block_size is None and load.block_size:
            self.block_size = load.block_size
        if self.model is None:
            self.model = self.engine.model()
        stats = self.node_stats(load)
        if stats is None:
            return False
        self.sink.send_stats(stats)
        return True

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.s.heartbeat_s):
            try:
                self.beat()
            except Exception:  # a heartbeat must never end the bridge
                log.exception("heartbeat failed")

    def run(self) -> None:
        """The main loop until :meth:`stop`; then the goodbye heartbeat."""
        self.beat()
        self.attach()
        self._heartbeat.start()
        try:
            while not self._stop.is_set():
                self.step()
        finally:
            self._stop.set()
            self._heartbeat.join(5)
            if (left := self.publisher.drain(5)) > 0:  # type: ignore[union-attr]
                log.error("stopping: %d event batches not delivered within 5 s", left)
            if self.load is not None and (bye := self.node_stats(self.load, "stopping")) is not None:
                self.sink.send_stats(msgspec.structs.replace(bye, ts=self.clock()))
            self.sink.flush(5)

    def stop(self) -> None:
        self._stop.set()

    def describe(self) -> dict[str, object]:
        """The bridge's counters (logged every minute, and by ``kvflow bridge`` at exit)."""
        src = self.source
        return {"node_id": self.s.node_id, "instance_id": self.instance_id, "instances": self.instances,
                "partial": self.partial, "resets": dict(self.resets), "engine_resets": self.engine_resets,
                "expected_seq": self.expected, "garbage": src.garbage if src else 0,
                "replays": src.replays if src else 0, "replayed_batches": src.replayed_batches if src else 0,
                "events_published": self.publisher.events_sent if self.publisher else 0,
                **{k: v for k, v in vars(self.stats).items()}}


def _priorities(ev: BlockStored) -> list[int] | None:
    """The event's per-block priorities when it carries one per block, each within 0..100 (else
    None: the default priority; a malformed list is not trusted)."""
    p = ev.priorities
    if p is None or len(p) != len(ev.block_hashes) or not all(
            isinstance(x, int) and MIN_PRIORITY <= x <= MAX_PRIORITY for x in p):
        return None
    return p
