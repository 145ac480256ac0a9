"""``make demo``'s run, end to end on the local services: every request answered, the cache used,
both nodes chosen, and every event the nodes emitted materialized (own topics, own database)."""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console
from rich.progress import Progress

from kvflow.demo import Demo

pytestmark = pytest.mark.integration


def test_the_demo_answers_every_request_from_the_cache_and_materializes_every_event(
        kafka_settings, migrated_database_url, reader_url, tmp_path, monkeypatch):
    for field in ("events_topic", "stats_topic", "dlq_topic", "control_topic"):
        monkeypatch.setenv(f"KVFLOW_KAFKA_{field.upper()}", getattr(kafka_settings, field))
    monkeypatch.setenv("KVFLOW_DATABASE_URL", migrated_database_url)
    monkeypatch.setenv("KVFLOW_DATABASE_READER_URL", reader_url)
    console = Console(file=io.StringIO(), width=120)
    demo = Demo(console, requests=30, use_local_stack=False, log_dir=tmp_path)
    try:
        router, node_urls = demo.start(lambda _m: None)
        with Progress(console=console) as progress:
            res = asyncio.run(demo.drive(router, progress))
        figures = asyncio.run(demo.pipeline_figures(node_urls))
    finally:
        demo.stop()
    assert (res.requests, res.failed) == (30, 0)
    assert res.cached_tokens > 0.5 * res.prompt_tokens  # long shared system prompts
    assert sorted(res.by_node) == ["demo-node-a", "demo-node-b"]
    assert figures["lag_events"] == 0
    assert figures["materialized"] == figures["published"] > 0  # this run's events, each once
    assert figures["pinned_blocks"] > 0  # the system prompts at priority 100
    assert demo.services == []  # stop() ended every process it started
