"""The dashboard in a real headless browser (Debian's chromium), with a screenshot."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import REQUIRE_SERVICES
from tests.support import ServiceProcess, free_port, http_ok, wait_for

pytestmark = pytest.mark.integration

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--hide-scrollbars", "--window-size=1400,900"]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if REQUIRE_SERVICES:
            pytest.fail("chromium is not installed (make test installs Debian's chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return exe


def test_the_dashboard_shows_nodes_composition_hit_rates_and_decisions(fleet, reader_url, tmp_path):
    exe = chromium()
    port = free_port()
    router = ServiceProcess(["router", "--port", str(port), "--log-level", "warning"],
                            {"KVFLOW_DATABASE_READER_URL": reader_url}, tmp_path / "router.log").start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{base}/healthz"), 30, what="the router")
        for i in range(6):  # some traffic, with a pinned system prompt
            body = {"prompt": "system prompt of the dashboard test. " * 4 + f"question {i % 3}", "max_tokens": 2,
                    "kv_retention": {"token_ranges": [{"start": 0, "end": 128, "priority": 100}]}}
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
        wait_for(lambda: len(httpx.get(f"{base}/v1/dashboard/data", timeout=5).json()["hit_rates"]) > 0, 30,
                 what="hit-rate samples")

        def run(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([exe, *FLAGS, f"--user-data-dir={tmp_path / 'chrome'}",
                                   "--virtual-time-budget=6000", *extra, f"{base}/dashboard"],
                                  capture_output=True, text=True, timeout=90, check=False)

        dom = run("--dump-dom").stdout
        assert 'data-ready="1"' in dom, dom[:500]
        assert "node-a" in dom and "node-b" in dom
        assert 'class="status live"' in dom
        assert "priority 100" in dom                      # composition bar of the pinned blocks
        assert "<polyline" in dom                         # the hit-rate chart has a line
        assert "blocks to prefill" in dom                 # decisions with their reasons
        shot = tmp_path / "dashboard.png"
        run(f"--screenshot={shot}")
        assert shot.is_file() and shot.stat().st_size > 10_000
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copyfile(shot, ARTIFACTS / "dashboard.png")
    finally:
        router.stop()
