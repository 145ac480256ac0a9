"""What a bridge reads from its engine over HTTP: load from Prometheus ``/metrics``, the model from
``/v1/models``, and (opt-in) the call that empties its prefix cache.

Metric names per engine (``EngineLoad.parse``):

=============  ==========================================  =========================================
               vLLM (``vllm/v1/metrics/loggers.py``)       SGLang (``srt/metrics/collector.py``)
=============  ==========================================  =========================================
running        ``vllm:num_requests_running``               ``sglang:num_running_reqs``
waiting        ``vllm:num_requests_waiting``               ``sglang:num_queue_reqs``
KV in use      ``vllm:kv_cache_usage_perc`` (0–1)          ``sglang:token_usage`` (0–1)
capacity       ``vllm:cache_config_info{num_gpu_blocks}``  ``sglang:max_total_num_tokens`` / page
block size     ``vllm:cache_config_info{block_size}``      (``--block-size``: the page size)
=============  ==========================================  =========================================

Data-parallel engines label each rank (``engine``); the sums are taken. TensorRT-LLM's
``trtllm-serve`` has no such page here: its bridge reports the events' state only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvflow.bridge")

Engine = Literal["vllm", "sglang", "trtllm"]

#: The engine's endpoint that empties its prefix cache (what ``--reset-engine-cache`` calls).
RESET_PATHS: dict[str, tuple[str, str]] = {"vllm": ("POST", "/reset_prefix_cache"),
                                           "sglang": ("POST", "/flush_cache")}


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of the engine's load."""

    running: int = 0
    waiting: int = 0
    #: the fraction of the KV cache held by running requests (0–1)
    usage: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None

    @staticmethod
    def parse(engine: Engine, text: str, page_size: int | None = None) -> EngineLoad:
        """The load in a Prometheus text page (see the module docstring for the names; TensorRT-LLM
        has none: its load is not known)."""
        if engine not in _NAMES:
            return EngineLoad()
        values: dict[str, float] = {}
        info: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:cache_config_info":
                    info = dict(s.labels)
                elif s.name in _NAMES[engine].values():
                    values[s.name] = values.get(s.name, 0.0) + s.value
        names = _NAMES[engine]
        ranks = max(1, text.count(names["usage"] + "{"))  # usage is a mean, the counts are sums
        usage = values.get(names["usage"], 0.0) / ranks
        blocks = size = None
        if engine == "vllm":
            blocks = _int(info.get("num_gpu_blocks"))
            size = _int(info.get("block_size"))
        elif engine == "sglang" and names["capacity"] in values:
            size = page_size
            blocks = int(values[names["capacity"]]) // max(1, page_size or 1)
        return EngineLoad(int(values.get(names["running"], 0)), int(values.get(names["waiting"], 0)),
                          min(1.0, max(0.0, usage)), blocks, size)


_NAMES: dict[str, dict[str, str]] = {
    "vllm": {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "usage": "vllm:kv_cache_usage_perc", "capacity": "vllm:cache_config_info"},
    "sglang": {"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
               "usage": "sglang:token_usage", "capacity": "sglang:max_total_num_tokens"},
}


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v not in (None, "", "None") else None
    except ValueError:
        return None


class EngineClient:
    """The engine's HTTP server (its OpenAI API and metrics)."""

    def __init__(self, engine: Engine, url: str, metrics_url: str | None = None, *, api_key: str | None = None,
                 timeout_s: float = 2.0, page_size: int | None = None) -> None:
        self.engine = engine
        self.url = url.rstrip("/")
        self.metrics_url = metrics_url or f"{self.url}/metrics"
        self.page_size = page_size
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self._unparsed = False

    def load(self) -> EngineLoad | None:
        """The engine's load now; None when its metrics do not answer (the node then goes stale)."""
        try:
            r = self.http.get(self.metrics_url)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("engine metrics %s: %s", self.metrics_url, exc)
            return None
        try:
            return EngineLoad.parse(self.engine, r.text, self.page_size)
        except ValueError as exc:  # answered, but not Prometheus text (trtllm-serve's /metrics is JSON)
            if not self._unparsed:
                log.warning("engine metrics %s are not Prometheus text (%s): load unknown", self.metrics_url, exc)
            self._unparsed = True
            return EngineLoad()

    def model(self) -> str | None:
        """The first model of ``GET /v1/models`` (None: the engine did not answer)."""
        try:
            r = self.http.get(f"{self.url}/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
            return str(data[0]["id"]) if data else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("engine models %s/v1/models: %s", self.url, exc)
            return None

    def reset_cache(self) -> bool:
        """Empty the engine's prefix cache (its events then say ``AllBlocksCleared``)."""
        method, path = RESET_PATHS.get(self.engine, ("", ""))
        if not path:
            return False
        try:
            self.http.request(method, f"{self.url}{path}").raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("engine cache reset %s%s: %s", self.url, path, exc)
            return False
        return True

    def close(self) -> None:
        self.http.close()
