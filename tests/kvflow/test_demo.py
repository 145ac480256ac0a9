"""``make demo``'s run, end to end on the local services: SmolLM2 on two nodes, every chat answered
in words, the cache used, both nodes chosen, and every event the nodes emitted materialized (own
topics, own database). The random-weight workload (``kvflow demo`` without ``--model``) is the
same code with text prompts; the fast tests of the node and router cover those paths."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.progress import Progress

from kvflow.demo import Demo, DemoResult

pytestmark = pytest.mark.integration


@pytest.fixture
def run_demo(kafka_settings, migrated_database_url, reader_url, tmp_path, monkeypatch):
    """Runs a Demo on topics and a database of its own: its result, its pipeline figures, the demo."""
    for field in ("events_topic", "stats_topic", "dlq_topic", "control_topic"):
        monkeypatch.setenv(f"KVFLOW_KAFKA_{field.upper()}", getattr(kafka_settings, field))
    monkeypatch.setenv("KVFLOW_DATABASE_URL", migrated_database_url)
    monkeypatch.setenv("KVFLOW_DATABASE_READER_URL", reader_url)

    def run(requests: int, model_dir: Path | None = None) -> tuple[DemoResult, dict[str, Any], Demo]:
        console = Console(file=io.StringIO(), width=120)
        demo = Demo(console, requests=requests, use_local_stack=False, log_dir=tmp_path, model_dir=model_dir)
        try:
            router, node_urls = demo.start(lambda _m: None)
            with Progress(console=console) as progress:
                res = asyncio.run(demo.drive(router, progress))
            figures = asyncio.run(demo.pipeline_figures(node_urls))
        finally:
            demo.stop()
        return res, figures, demo

    return run


def test_the_demo_answers_every_chat_in_words_from_the_cache_and_materializes_every_event(run_demo, smollm2_dir):
    """``make demo``'s run: SmolLM2 on both nodes, chats with real questions, answered in words."""
    res, figures, demo = run_demo(12, smollm2_dir)
    assert (res.requests, res.failed) == (12, 0), res.errors
    assert ("What is the capital of France?", "The capital of France is Paris.") in res.answers
    assert res.cached_tokens > 0.3 * res.prompt_tokens  # the system prompts, in BPE tokens
    assert sorted(res.by_node) == ["demo-node-a", "demo-node-b"]
    assert len(res.ttft_cold) + len(res.ttft_cached) == 12 and res.ttft_cold and res.ttft_cached
    assert figures["lag_events"] == 0
    assert figures["materialized"] == figures["published"] > 0  # this run's events, each once
    assert figures["pinned_blocks"] > 0  # the system prompts at priority 100
    assert demo.services == []  # stop() ended every process it started


def test_the_summary_table_has_no_empty_header_row():
    from kvflow.demo import _summary

    out = io.StringIO()
    res = DemoResult(requests=3, prompt_tokens=100, cached_tokens=50)
    _summary(Console(file=out, width=100), res, {"published": 7, "materialized": 7, "history_rows": 9,
                                                  "lag_events": 0, "pinned_blocks": 2}, 1.0, "http://r")
    lines = out.getvalue().splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("┌"))
    assert "requests (failed)" in lines[top + 1]  # the first row is data, not an empty header


def test_the_readme_tails_a_node_the_demo_starts():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    named = re.findall(r"kvflow events tail --node (\S+)", readme)
    assert named and all(re.fullmatch(r"demo-node-[ab]", n) for n in named), named


def test_the_random_weight_workload_pins_each_system_prompt_by_its_bytes():
    """``kvflow demo`` without a model: text prompts, a byte per token, the system prompt pinned."""
    from kvflow.demo_workload import completions

    reqs = list(completions(40))
    kinds = {k for k, _, _ in reqs}
    assert kinds == {"system prompt", "conversation", "one-off"}
    for kind, path, body in reqs:
        assert path == "/v1/completions" and body["max_tokens"] == 8
        if kind != "one-off":
            [pinned] = body["kv_retention"]["token_ranges"]
            system = body["prompt"][:pinned["end"]]
            assert pinned["priority"] == 100 and system.endswith(".") and "User:" not in system
            assert "User:" in body["prompt"][pinned["end"]:]
