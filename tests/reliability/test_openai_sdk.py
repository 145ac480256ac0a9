"""The official `openai` SDK against kvflow as a user points it: a real router process in front of
two real node processes, a real materializer, Kafka and PostgreSQL. Completions and chat, streamed
and not, the common parameters, the models list, errors as the SDK's exception types, and a
multi-turn chat that stays on the node holding its history."""

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

MODEL = "kvflow-tiny-llama"


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, pg_owner_url, tmp_path_factory):
    """A router process, two node processes and a materializer, on topics and a database of their own."""
    tmp = tmp_path_factory.mktemp("sdk")
    with own_topics(kafka_bootstrap) as kafka, scratch_database(pg_owner_url, "kvflow_sdk") as owner:
        reader_role = make_url(DatabaseSettings().reader())
        reader = make_url(owner).set(username=reader_role.username, password=reader_role.password)
        mat = materializer(kafka, owner, tmp).start()
        nodes = [start_node(kafka, tmp, f"sdk-{x}", num_blocks="256") for x in "ab"]
        port = free_port()
        router = ServiceProcess(["router", "--port", str(port), "--log-level", "warning"],
                                {**kafka_env(kafka), "KVFLOW_DATABASE_READER_URL":
                                 reader.render_as_string(hide_password=False),
                                 "KVFLOW_ROUTER_NODES_CACHE_S": "0.1",
                                 # the tail guard on: it sees each stream's first chunk
                                 "KVFLOW_ROUTER_TTFT_QUANTILE": "0.9"}, tmp / "router.log").start()
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: all(applied_through_id(owner, f"sdk-{x}") for x in "ab"), 60, what="both nodes")

            def routable() -> bool:
                try:
                    r = httpx.post(f"{base}/v1/route", json={"prompt": "ping"}, timeout=2)
                except httpx.HTTPError:
                    return False
                return r.status_code == 200 and sum(c["eligible"] for c in r.json()["candidates"]) == 2

            wait_for(routable, 60, what="the router to route to both nodes")
            yield {"client": openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60),
                   "db": owner, "base": base}
        finally:
            router.stop()
            for proc, _ in nodes:
                proc.stop()
            mat.stop()


@pytest.fixture
def sdk(fleet):
    return fleet["client"]


def test_completions_plain_and_streamed_with_usage(sdk):
    out = sdk.completions.create(model=MODEL, prompt="The cache remembers", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens == 8
    chunks = list(sdk.completions.create(model=MODEL, prompt="The cache remembers", max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_the_tail_guard_sees_every_answer_and_learns_the_nodes_rates(fleet, sdk):
    """With the guard on, every proxied request leaves its node's prefill queue when it answers
    (a stream's first chunk, a whole response), and the first tokens measure each node's rate."""
    for i in range(6):
        list(sdk.completions.create(model=MODEL, prompt=f"Tail guard {i} " * 20, max_tokens=2, temperature=0,
                                    stream=True))
        sdk.completions.create(model=MODEL, prompt=f"Whole {i} " * 20, max_tokens=2, temperature=0)
    guard = httpx.get(f"{fleet['base']}/v1/stats", timeout=10).json()["tail_guard"]
    assert guard["quantile"] == 0.9 and guard["observed"] >= 12
    prefill = guard["prefill"]
    assert prefill and all(q["pending"] == 0 and q["pending_blocks"] == 0 for q in prefill.values())
    assert sum(q["measured"] for q in prefill.values()) >= 1  # rates measured from real first tokens
    assert all(q["s_per_block"] > 0 for q in prefill.values())


def test_chat_plain_and_streamed(sdk):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    out = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 6
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_common_parameters_pass_through_the_router(sdk):
    out = sdk.completions.create(model=MODEL, prompt="Sampling through the router", max_tokens=6, temperature=0.8,
                                 top_p=0.9, n=2, seed=7, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is not None and len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in out.choices)
    greedy = sdk.completions.create(model=MODEL, prompt="Sampling through the router", max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    stop = text[3:5] if len(text) >= 5 else None
    if stop:
        cut = sdk.completions.create(model=MODEL, prompt="Sampling through the router", max_tokens=12,
                                     temperature=0, stop=[stop])
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=4, logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs is not None and len(chat.choices[0].logprobs.content) == 4


def test_models_list_names_the_fleets_model(sdk):
    models = sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_errors_are_the_sdks_exception_types(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=4, best_of=3)
    assert "best_of" in str(bad.value)


def test_a_multi_turn_chat_stays_on_the_node_holding_its_history(fleet, sdk):
    system = {"role": "system", "content": "You answer questions about a long policy. " + "Rule. " * 300}
    messages = [system, {"role": "user", "content": "What is rule one?"}]
    first = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_completion_tokens=4,
                                                          temperature=0)
    answer = first.parse()
    node = first.headers["x-kvflow-node"]
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "And rule two?"}]
    time.sleep(1.2)  # two heartbeats (0.5 s) after the first turn: they report its events ...
    wait_for(lambda: applied_through_id(fleet["db"], node), 30, what="the first turn's blocks in PostgreSQL")
    second = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_completion_tokens=4,
                                                           temperature=0)
    assert second.headers["x-kvflow-node"] == node  # ... so the second turn goes where its history is
    block = 32
    cached = second.parse().usage.prompt_tokens_details.cached_tokens
    assert cached >= (answer.usage.prompt_tokens // block) * block
    # the router rendered the chat as the node did: it matched those blocks before sending it
    assert int(second.headers["x-kvflow-matched-tokens"]) >= (answer.usage.prompt_tokens // block) * block


def test_route_with_messages_predicts_the_cached_tokens_the_node_then_reports(fleet, sdk):
    """``POST /v1/route`` takes a chat's messages, renders them as the node will, and predicts the
    very tokens the node then serves from its cache."""
    messages = [{"role": "system", "content": "A fixed preamble for prediction. " * 40},
                {"role": "user", "content": "Which node holds this?"}]
    first = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_completion_tokens=2,
                                                          temperature=0)
    node = first.headers["x-kvflow-node"]
    time.sleep(1.2)
    wait_for(lambda: applied_through_id(fleet["db"], node), 30, what="the chat's blocks in PostgreSQL")
    routed = httpx.post(f"{fleet['base']}/v1/route", json={"model": MODEL, "messages": messages}, timeout=10)
    assert routed.status_code == 200, routed.text
    predicted = routed.json()
    prompt_tokens = first.parse().usage.prompt_tokens
    assert predicted["node_id"] == node and predicted["prompt_tokens"] == prompt_tokens
    assert predicted["matched_tokens"] == prompt_tokens // 32 * 32 > 0  # every full block
    again = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_completion_tokens=2,
                                                          temperature=0)
    assert again.headers["x-kvflow-node"] == node
    assert again.parse().usage.prompt_tokens_details.cached_tokens == predicted["cached_tokens"]
    both = httpx.post(f"{fleet['base']}/v1/route", json={"prompt": "x", "messages": messages}, timeout=10)
    assert both.status_code == 422 and "exactly one of prompt, token_ids and messages" in both.text


def test_n_sequences_share_the_prompts_blocks(sdk):
    prompt = "Shared prompt blocks. " * 12  # 264 byte tokens: 8 full blocks of 32
    raw = sdk.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=3, n=3, temperature=1.0,
                                                   seed=11)
    out = raw.parse()
    assert [c.index for c in out.choices] == [0, 1, 2]
    cached = out.model_extra["kvflow"]["cached_tokens"]
    assert cached[1] >= 8 * 32 and cached[2] >= 8 * 32  # the later sequences reuse the first one's blocks
    assert out.usage.prompt_tokens == len(prompt.encode())  # the prompt counts once
    assert out.usage.completion_tokens == 9


def test_chat_with_tools_rendered_content_parts_and_a_stop_string(sdk):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a rule up.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "text", "text": "Find rule 7."}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": "{\"n\": 7}"}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "Rule 7: be brief."}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                        max_completion_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    assert whole.usage.prompt_tokens > 100
    if len(text) >= 6:
        stop = text[4:6]
        cut = sdk.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                          max_completion_tokens=16, temperature=0, stop=stop)
        streamed = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, tool_choice="none", max_completion_tokens=16,
            temperature=0, stop=stop, stream=True) if c.choices)
        assert cut.choices[0].message.content == streamed == text[:text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_what_a_node_cannot_honour_is_a_bad_request_naming_it(sdk):
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    response_format={"type": "json_object"})
    assert "response_format" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as bad:  # tools need tool_choice "none": no function calling
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[
            {"type": "function", "function": {"name": "f"}}])
    assert "tool_choice" in str(bad.value)
    # unknown extra fields are accepted and ignored, as vLLM does
    out = sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"my_tracing_tag": "abc"})
    assert out.usage.completion_tokens == 2


def test_models_name_their_nodes_and_unknown_paths_are_openai_errors(fleet, sdk):
    (model,) = sdk.models.list().data
    assert sorted(model.model_extra["kvflow"]["nodes"]) == ["sdk-a", "sdk-b"]
    base = str(sdk.base_url).rstrip("/")
    for method, path, status in (("GET", "/nope", 404), ("DELETE", "/models", 405), ("GET", "/completions", 405)):
        r = httpx.request(method, f"{base}{path}", timeout=5)
        assert r.status_code == status and set(r.json()["error"]) >= {"message", "type"}, r.text
