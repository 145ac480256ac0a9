"""Sending a hub copy (:mod:`routing_api.hubs`): the hub's tokens to the target node, as a completion
of one token.

The body is ``{"prompt": [the hub's token ids], "max_tokens": 1, "stream": false}`` with the request's
``model`` and ``cache_salt`` when it had them: token ids, so the node computes exactly the blocks the
router hashed (a chat's rendered template included), and the same salt, so the blocks it stores are
the ones the next request of the hub will look up. A request with a LoRA adapter sends no copy.

It is accounted as a proxied request (:meth:`RouterState.start_proxy`): in flight while it runs, its
blocks the node lacks as prefill work routed to the node and as a prefill queued there, so the
next decisions see the node busy with it. It runs in the background (the request that called for
it is proxied at once) and is never retried; a node that fails it is suspect, as for any request.
``kvflow_router_warmups_total{node, outcome}`` counts them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from routing_api.decisions import Routed
from routing_api.hubs import Warmup
from routing_api.proxy import NOT_SENT
from routing_api.state import RouterState

log = logging.getLogger("kvflow.router")


def warmup_body(tokens: Sequence[int], warm: Warmup, block_size: int, model: str | None,
                salt: str | None) -> dict[str, Any]:
    """The completion that copies ``warm``'s hub: its first ``warm.blocks`` blocks of ``tokens``."""
    body: dict[str, Any] = {"prompt": list(tokens[:warm.blocks * block_size]), "max_tokens": 1, "stream": False}
    if model is not None:
        body["model"] = model
    if salt is not None:
        body["cache_salt"] = salt
    return body


def send_warmup(state: RouterState, routed: Routed, model: str | None, salt: str | None,
                lora_id: int | None) -> asyncio.Task[None] | None:
    """Send the hub copy ``routed`` calls for, in the background (None: it calls for none, or the
    request has a LoRA adapter)."""
    warm, prompt = routed.warmup, routed.prompt
    if warm is None or prompt is None or lora_id is not None:
        return None
    body = warmup_body(prompt.tokens, warm, prompt.fleet.block_size, model, salt)
    task = asyncio.get_running_loop().create_task(_send(state, warm, body))
    state.warming.add(task)
    task.add_done_callback(state.warming.discard)
    return task


async def _send(state: RouterState, warm: Warmup, body: dict[str, Any]) -> None:
    c = warm.target
    done = state.start_proxy(c.node_id, warm.blocks, warm.work, c.block_size)
    outcome, ran = "upstream_error", True
    try:
        r = await state.client.post(f"{c.url.rstrip('/')}/v1/completions", json=body)
        outcome = "ok" if r.status_code < 400 else "client_error" if r.status_code < 500 else "upstream_error"
        if outcome != "ok":
            log.warning("hub copy to %s answered %d: %s", c.node_id, r.status_code, r.text[:200])
    except asyncio.CancelledError:  # the router is closing
        outcome = "cancelled"
        raise
    except NOT_SENT as exc:
        ran = False
        log.warning("hub copy to %s not sent: %s: %s", c.node_id, type(exc).__name__, exc)
    except httpx.HTTPError as exc:
        log.warning("hub copy to %s failed: %s: %s", c.node_id, type(exc).__name__, exc)
    finally:
        done(outcome, ran=ran)
        state.metrics.warmups.labels(c.node_id, outcome).inc()
