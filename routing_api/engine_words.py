"""One retention in each engine's words (docs/router.md, "Retention per engine").

The router decides a request's retention once, as kvflow's ``kv_retention`` object (token ranges
at priorities 0–100 with durations, a decode priority: TensorRT-LLM's model; ``routing_api.retained``),
and sends it to the node it routes to in the words that node's engine takes (``NodeStats.engine``,
which a bridge sets):

================  =====================================================  ========
engine            sent as                                                honoured
================  =====================================================  ========
``kvflow``        the body's ``kv_retention``                            all
``vllm+kvflow``   ``vllm_xargs.kv_retention`` (its JSON text; kvflow's   all
                  vLLM plugin reads it, docs/vllm-retention.md)
``vllm``          the same (stock vLLM keeps it as an unused extra arg;  none
                  a plugin the bridge has not seen yet honours it)
``sglang``        the body's ``priority``: the highest priority of the   part
                  request (per request, not per range; no durations;
                  needs ``--radix-eviction-policy priority``)
``trtllm``        nothing: ``trtllm-serve`` takes no retention over      none
                  HTTP (only its Python API's ``KvCacheRetentionConfig``)
================  =====================================================  ========

For every engine but kvflow's node, the fields kvflow reads and the engine does not
(``kv_retention``, ``prompt_cache_options``, ``prompt_cache_retention``: the router has turned
them into the retention above) leave the body: ``trtllm-serve`` refuses unknown fields, vLLM and
SGLang would only log them. A client's own ``priority`` (SGLang) or ``vllm_xargs.kv_retention``
(vLLM) is kept, not overwritten.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from eventbus.protocol import DEFAULT_PRIORITY, ENGINE_KVFLOW

#: kvflow's retention fields, which only kvflow's node reads (the router sends the result instead)
KVFLOW_FIELDS = ("kv_retention", "prompt_cache_options", "prompt_cache_retention")
#: the key of ``vllm_xargs`` kvflow's vLLM plugin reads (``kvflow_vllm.retention.EXTRA_KEY``)
VLLM_KEY = "kv_retention"
VLLM_PLUGIN = "vllm+kvflow"

Honoured = Literal["all", "part", "none"]


@dataclass(frozen=True)
class Words:
    """A retention as one engine takes it."""

    engine: str
    #: fields to set in the body (None: the engine gets nothing from the retention)
    fields: dict[str, Any] | None
    #: kvflow's own fields to take out of the body
    drop: tuple[str, ...]
    honoured: Honoured
    #: what the engine does not honour, in words (the answer's ``kvflow.router.retention.notes``)
    notes: tuple[str, ...] = ()

    def apply(self, body: dict[str, Any]) -> bool:
        """Put these words into ``body`` (a parsed request); whether it changed."""
        changed = False
        for name in self.drop:
            if name in body:
                del body[name]
                changed = True
        for name, value in (self.fields or {}).items():
            if body.get(name) != value:
                body[name] = value
                changed = True
        return changed


def request_priority(retention: dict[str, Any]) -> int:
    """The one priority of a request (engines without token ranges): its highest range's, at least
    its decode priority (what it asks to keep longest; a retention of no ranges: the decode's)."""
    ranges = retention.get("token_ranges") or []
    decode = int(retention.get("decode_priority", DEFAULT_PRIORITY))
    return max([int(r["priority"]) for r in ranges] + [decode])


def in_words(engine: str, retention: dict[str, Any] | None, body: dict[str, Any], *,
             in_body: bool = True) -> Words:
    """``retention`` (a ``kv_retention`` object; None: the request has none) for a node of
    ``engine``, given the request's ``body``; ``in_body``: for kvflow's node, whether it goes in the
    body (False: the node makes the same retention of the body itself)."""
    if engine == ENGINE_KVFLOW:
        return Words(engine, {"kv_retention": retention} if retention is not None and in_body else None, (), "all")
    if retention is None:
        return Words(engine, None, _present(body), "none")
    if engine in ("vllm", VLLM_PLUGIN):
        xargs = body.get("vllm_xargs")
        xargs = dict(xargs) if isinstance(xargs, dict) else {}
        notes: tuple[str, ...] = ()
        if VLLM_KEY in xargs:
            notes = ("the request's own vllm_xargs.kv_retention was sent as it is",)
        else:
            xargs[VLLM_KEY] = json.dumps(retention, separators=(",", ":"))
        if engine == "vllm":
            notes += ("stock vLLM evicts least recently used first: the retention is sent, and honoured only where "
                      "kvflow's plugin is loaded (docs/vllm-retention.md)",)
        return Words(engine, {"vllm_xargs": xargs}, _present(body), "all" if engine == VLLM_PLUGIN else "none", notes)
    if engine == "sglang":
        p = request_priority(retention)
        notes = ("SGLang keeps one priority per request, not per token range: every block of the request is kept "
                 f"at {p}",)
        if any(r.get("duration_s") is not None for r in retention.get("token_ranges") or []) \
                or retention.get("decode_duration_s") is not None:
            notes += ("SGLang has no retention durations: the priority does not expire",)
        notes += ("honoured with --radix-eviction-policy priority (with --enable-priority-scheduling it also orders "
                  "the queue)",)
        if "priority" in body:
            return Words(engine, None, _present(body), "part",
                         ("the request's own priority was sent as it is",) + notes[1:])
        return Words(engine, {"priority": p}, _present(body), "part", notes)
    if engine == "trtllm":
        return Words(engine, None, _present(body), "none",
                     ("trtllm-serve takes no retention over HTTP (its KvCacheRetentionConfig is in the Python API "
                      "only): not sent",))
    return Words(engine, None, _present(body), "none", (f"engine {engine!r}: kvflow knows no retention words for it",))


def _present(body: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f for f in KVFLOW_FIELDS if f in body)
