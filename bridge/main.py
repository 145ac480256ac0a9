"""Assembling and running one bridge from settings (``kvflow bridge``): Kafka, the engine's
sockets or HTTP events, its metrics; until a stop signal, then the goodbye."""

from __future__ import annotations

import logging
import time

from bridge.engine_http import EngineClient
from bridge.service import Bridge, BridgeSettings
from bridge.trtllm import TrtllmPoller
from bridge.zmq_source import ZmqSource
from eventbus.config import KafkaSettings
from eventbus.protocol import InstanceId
from eventbus.publisher import ControlListener, KafkaSink, Sink

log = logging.getLogger("kvflow.bridge")


def build(s: BridgeSettings, kafka: KafkaSettings | None, sink: Sink | None = None) -> Bridge:
    """The bridge for ``s``: its engine client (one first scrape), source, sink and resync listener.

    Raises:
        ValueError: vLLM or SGLang without ``events``.
    """
    if s.engine in ("vllm", "sglang") and not s.events:
        raise ValueError(f"kvflow bridge {s.engine} needs --events tcp://HOST:PORT (the engine's KV event "
                         "publisher)")
    key = s.engine_api_key.get_secret_value() if s.engine_api_key else None
    engine = EngineClient(s.engine, s.engine_url, s.metrics_url, api_key=key, page_size=s.block_size)
    load = engine.load() if s.engine != "trtllm" else None
    source = ZmqSource(s.events, s.replay, topic=s.topic, replay_timeout_s=s.replay_timeout_s) if s.events else None
    control = None
    if sink is None:
        kafka = kafka or KafkaSettings()
        sink = KafkaSink(kafka, s.node_id)
        control = ControlListener(kafka, s.node_id, InstanceId(f"bridge-{int(time.time())}"))
    bridge = Bridge(s, sink, engine, source, control, load=load)
    if s.engine == "trtllm":
        bridge.poll_events = TrtllmPoller(bridge).poll
    return bridge


def run(bridge: Bridge) -> None:
    """Run until :meth:`Bridge.stop` or a stop signal (the caller's), then close everything."""
    if bridge.control is not None:
        bridge.control.start()
    try:
        bridge.run()
    finally:
        log.info("bridge %s: %s", bridge.s.node_id, bridge.describe())
        if bridge.control is not None:
            bridge.control.close()
        if bridge.source is not None:
            bridge.source.close()
        bridge.engine.close()
        bridge.sink.close()
