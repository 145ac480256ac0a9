"""A real model through the whole system, as a user runs it: ``kvflow model pull smollm2-135m``'s
folder served by a node process, a router process in front of it (tokenizing with the same
``tokenizer.json``), a materializer, Kafka and PostgreSQL; the official ``openai`` SDK asks."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from sqlalchemy.engine import make_url

from kvflow.bench.scratch import scratch_database
from state_store.config import DatabaseSettings
from tests.inference_node.test_node_kafka import start_node
from tests.support import ServiceProcess, applied_through_id, free_port, kafka_env, materializer, own_topics, wait_for

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, pg_owner_url, tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("real")
    with own_topics(kafka_bootstrap) as kafka, scratch_database(pg_owner_url, "kvflow_real") as owner:
        reader_role = make_url(DatabaseSettings().reader())
        reader = make_url(owner).set(username=reader_role.username, password=reader_role.password)
        mat = materializer(kafka, owner, tmp).start()
        node, _ = start_node(kafka, tmp, "real-a", model_dir=str(smollm2_dir), num_blocks="128")
        port = free_port()
        router = ServiceProcess(["router", "--port", str(port), "--log-level", "warning"],
                                {**kafka_env(kafka), "KVFLOW_DATABASE_READER_URL":
                                 reader.render_as_string(hide_password=False), "KVFLOW_ROUTER_NODES_CACHE_S": "0.1",
                                 "KVFLOW_ROUTER_TOKENIZER_DIR": str(smollm2_dir)}, tmp / "router.log").start()
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: applied_through_id(owner, "real-a"), 60, what="the node's events")

            def routable() -> bool:
                try:
                    r = httpx.post(f"{base}/v1/route", json={"prompt": "ping"}, timeout=2)
                except httpx.HTTPError:
                    return False
                return r.status_code == 200 and any(c["eligible"] for c in r.json()["candidates"])

            wait_for(routable, 60, what="the router to route to the node")
            yield {"client": openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120),
                   "db": owner, "base": base}
        finally:
            router.stop()
            node.stop()
            mat.stop()


def test_the_model_answers_through_the_router_and_streams_stop_at_im_end(fleet):
    sdk = fleet["client"]
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    answer = sdk.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_completion_tokens=64)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens < 64
    stream = sdk.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_completion_tokens=64,
                                         stream=True, stream_options={"include_usage": True})
    text, finish, usage = [], None, None
    for chunk in stream:
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(text) == answer.choices[0].message.content == "The capital of France is Paris."
    assert finish == "stop" and "<|im_end|>" not in "".join(text)
    assert usage is not None and usage.completion_tokens == answer.usage.completion_tokens


def test_the_router_predicts_the_tokens_the_node_serves_from_its_cache(fleet):
    """The router renders and tokenizes the chat as the node does, so it matches the very blocks
    the node cached: its prediction is what the node then reports."""
    sdk = fleet["client"]
    messages = [{"role": "system", "content": "You are the support assistant of an airline. " +
                 " ".join(f"Rule {i}: bags over 23 kg pay a fee of {i} euros." for i in range(30))},
                {"role": "user", "content": "How much for a bag of 25 kg?"}]
    first = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0,
                                                          max_completion_tokens=4)
    prompt_tokens = first.parse().usage.prompt_tokens
    assert prompt_tokens > 300  # real BPE tokens, not bytes
    time.sleep(1.2)
    wait_for(lambda: applied_through_id(fleet["db"], "real-a"), 30, what="the chat's blocks in PostgreSQL")
    routed = httpx.post(f"{fleet['base']}/v1/route", json={"model": MODEL, "messages": messages}, timeout=10).json()
    assert routed["prompt_tokens"] == prompt_tokens and routed["matched_tokens"] == prompt_tokens // 32 * 32
    again = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens == routed["cached_tokens"] > 0
