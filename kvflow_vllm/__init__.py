"""kvflow's retention inside vLLM: a vLLM general plugin (docs/vllm-retention.md).

Installed with kvflow (``pip install 'kvflow[vllm]'`` in vLLM's own environment), vLLM loads it
through the entry point group ``vllm.general_plugins`` (name ``kvflow_retention``) in each of its
processes; :func:`register` then, once per process and only on the vLLM versions it was tested
with (:data:`TESTED`):

1. replaces ``vllm.v1.core.block_pool.FreeKVCacheBlockQueue`` with
   :class:`~kvflow_vllm.queue` 's ``RetentionFreeQueue`` (kvflow's retention order for cached
   blocks; vLLM's own order for the rest: nothing changes without retention);
2. wraps ``BlockPool.cache_full_blocks`` (the blocks a request caches) and
   ``KVCacheManager.allocate_slots`` (the cached blocks a request reuses) so that a request's
   retention claims its blocks.

A request carries its retention in vLLM's own per-request field: ``vllm_xargs`` in the OpenAI
body (``SamplingParams.extra_args`` offline), key ``kv_retention``, the JSON text (or, offline, the
dict) of kvflow's ``kv_retention`` object: ``{"token_ranges": [{"start", "end", "priority",
"duration_s"}], "decode_priority", "decode_duration_s"}``. A block's retention is
``KvCacheRetentionConfig.block_retention`` — the rule kvflow's node runs.

On another vLLM version, or with ``KVFLOW_VLLM_RETENTION=off``, it logs why and changes nothing.
``VLLM_PLUGINS`` (vLLM's own filter by entry-point name) can also leave it out.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvflow_vllm.retention import EXTRA_KEY, parse_retention, retention_of

__all__ = ["EXTRA_KEY", "TESTED", "parse_retention", "register", "retention_of", "status"]

log = logging.getLogger("vllm.kvflow")

#: The vLLM versions whose internals the plugin was tested on.
TESTED = ("0.32.0", "0.33.0")

_state: dict[str, Any] = {"registered": False, "reason": None}


def status() -> dict[str, Any]:
    """Whether the plugin changed vLLM in this process, and if not, why."""
    return dict(_state)


def register() -> None:
    """The entry point vLLM calls (``vllm.general_plugins``): patch vLLM once, or say why not."""
    if _state["registered"] or _state["reason"]:
        return
    if os.environ.get("KVFLOW_VLLM_RETENTION", "on").lower() in ("0", "off", "false", "no"):
        _state["reason"] = "KVFLOW_VLLM_RETENTION=off"
        log.info("kvflow retention plugin: off (KVFLOW_VLLM_RETENTION); vLLM unchanged")
        return
    import vllm

    version = getattr(vllm, "__version__", "?").split("+")[0]
    if version not in TESTED:
        _state["reason"] = f"vLLM {version} is not one of the versions tested ({', '.join(TESTED)})"
        log.warning("kvflow retention plugin: NOT active: %s; vLLM unchanged", _state["reason"])
        return
    from kvflow_vllm.hooks import patch

    patch()
    _state["registered"] = True
    log.info("kvflow retention plugin active (vLLM %s): the prefix cache evicts by priority (0-100, LRU within "
             "a priority; durations fall back to 35) for requests with vllm_xargs.%s; unchanged without it",
             version, EXTRA_KEY)
