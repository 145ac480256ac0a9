"""A vLLM request's retention: kvflow's ``kv_retention`` object in ``SamplingParams.extra_args``.

The OpenAI body's ``vllm_xargs`` takes flat values only, so the object travels as its JSON text
(``{"vllm_xargs": {"kv_retention": "{\\"token_ranges\\": [...]}"}}``); offline (``LLM.generate``)
``extra_args`` may hold the dict itself. The config is kvflow's own
(``inference_node.kv.retention.KvCacheRetentionConfig``), parsed once per request.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from inference_node.kv.retention import KvCacheRetentionConfig, RetentionConfigError, TokenRange

log = logging.getLogger("vllm.kvflow")

#: The key of ``extra_args`` (``vllm_xargs``) that carries a request's retention.
EXTRA_KEY = "kv_retention"
_ATTR = "_kvflow_retention"  # the parsed config, cached on vLLM's Request


def retention_of(request: Any) -> KvCacheRetentionConfig | None:
    """The retention a vLLM ``Request`` carries (None: none, or one that cannot be read: logged)."""
    cached = request.__dict__.get(_ATTR, False)
    if cached is not False:
        return cached  # type: ignore[no-any-return]
    cfg = None
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    raw = extra.get(EXTRA_KEY) if isinstance(extra, dict) else None
    if raw is not None:
        try:
            cfg = parse_retention(raw)
        except (ValueError, TypeError, RetentionConfigError) as exc:
            log.warning("kvflow: request %s: vllm_xargs.%s ignored: %s", getattr(request, "request_id", "?"),
                        EXTRA_KEY, exc)
    request.__dict__[_ATTR] = cfg
    return cfg


def parse_retention(raw: str | dict[str, Any]) -> KvCacheRetentionConfig:
    """kvflow's ``kv_retention`` object (its JSON text, or the dict) as a retention config.

    Raises:
        ValueError, TypeError, RetentionConfigError: not such an object.
    """
    d = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(d, dict):
        raise TypeError("kv_retention must be an object")
    unknown = set(d) - {"token_ranges", "decode_priority", "decode_duration_s"}
    if unknown:
        raise ValueError(f"unknown kv_retention fields {sorted(unknown)}")
    ranges = tuple(TokenRange(int(t["start"]), None if t.get("end") is None else int(t["end"]), t["priority"],
                              t.get("duration_s")) for t in d.get("token_ranges") or ())
    return KvCacheRetentionConfig(token_ranges=ranges, decode_priority=d.get("decode_priority", 35),
                                  decode_duration_s=d.get("decode_duration_s"))
