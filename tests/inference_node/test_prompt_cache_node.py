"""Prompt-caching marks on a node, sent by the official ``openai`` SDK through its own typed
arguments (``prompt_cache_breakpoint`` on a content part, ``prompt_cache_options``,
``prompt_cache_retention``) and as Anthropic's ``cache_control`` in a raw body: where each
breakpoint falls (exact token positions through the chat template), what is retained (the blocks'
priority in ``/v1/kv/state``), OpenAI's "latest N" rule, ``kv_retention`` winning, bad input
refused naming the field, and a flood of one-off prompts that evicts unmarked prefixes and not
the marked ones."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from inference_node.server import create_app
from openai_api.prompt_cache import BREAKPOINT_PRIORITY

from .conftest import make_node

MODEL = "kvflow-tiny-llama"
SYSTEM = "You answer questions about the kvflow policy handbook. " * 4  # 220 bytes: the byte model's tokens


def _fleet(num_blocks: int) -> tuple[TestClient, openai.OpenAI]:
    node = make_node(num_blocks=num_blocks)
    client = TestClient(create_app(node))
    client.__enter__()
    client.node = node  # type: ignore[attr-defined]
    return client, openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client,
                                 max_retries=0)


@pytest.fixture
def fresh():
    client, sdk = _fleet(256)
    yield client, sdk
    client.__exit__(None, None, None)
    client.node.close()  # type: ignore[attr-defined]


def marked(text: str, ttl: str | None = None) -> dict:
    bp: dict = {"mode": "explicit"}
    if ttl:
        bp["ttl"] = ttl
    return {"type": "text", "text": text, "prompt_cache_breakpoint": bp}


def kvflow_of(out) -> dict:
    return out.model_extra["kvflow"]


def priorities(client: TestClient) -> list[int]:
    """Each cached block's priority, in chain order (one chain: the only prompt sent)."""
    blocks = client.get("/v1/kv/state").json()["blocks"]
    return [b["priority"] for b in blocks]


def test_a_breakpoint_sent_by_the_sdk_retains_the_system_prompt_to_its_exact_end(fresh):
    client, sdk = fresh
    out = sdk.chat.completions.create(
        model=MODEL, max_completion_tokens=2, prompt_cache_options={"mode": "explicit"},
        messages=[{"role": "system", "content": [marked(SYSTEM, "12h")]},
                  {"role": "user", "content": "What is rule one?"}])
    info = kvflow_of(out)["prompt_cache"]
    end = len(f"<|system|>\n{SYSTEM}\n".encode())  # the byte model: one token per byte
    assert info["source"] == "prompt_cache" and info["ignored"] == []
    assert info["breakpoints"] == [{"field": "messages[0].content[0].prompt_cache_breakpoint",
                                    "kind": "prompt_cache_breakpoint", "position": end, "ttl_s": 43200.0}]
    # rounded down to whole blocks: the block straddling the breakpoint is not retained
    assert info["retained"] == [{"start": 0, "end": end // 16 * 16, "priority": BREAKPOINT_PRIORITY,
                                 "duration_s": 43200.0}]
    prios = priorities(client)
    assert prios[:end // 16] == [BREAKPOINT_PRIORITY] * (end // 16)
    assert set(prios[end // 16:]) == {35}  # the rest of the prompt and the output at the default


def test_a_part_inside_a_message_and_the_implicit_breakpoint(fresh):
    client, sdk = fresh
    doc = "Section A. " * 12
    out = sdk.chat.completions.create(
        model=MODEL, max_completion_tokens=2, prompt_cache_retention="24h",
        messages=[{"role": "developer", "content": SYSTEM},
                  {"role": "user", "content": [marked(doc), {"type": "text", "text": "Summarize it."}]}])
    info = kvflow_of(out)["prompt_cache"]
    system_end = len(f"<|system|>\n{SYSTEM}\n".encode())
    # the cut rendering "<|user|>\n" + doc + "\n" shares the newline that joins the parts
    part_end = system_end + len(f"<|user|>\n{doc}\n".encode())
    assert [(b["kind"], b["position"], b["ttl_s"]) for b in info["breakpoints"]] == [
        ("implicit", system_end, 86400.0), ("prompt_cache_breakpoint", part_end, 86400.0)]
    assert info["retained"] == [
        {"start": 0, "end": system_end // 16 * 16, "priority": BREAKPOINT_PRIORITY, "duration_s": 86400.0},
        {"start": system_end // 16 * 16, "end": part_end // 16 * 16, "priority": BREAKPOINT_PRIORITY,
         "duration_s": 86400.0}]
    assert priorities(client).count(BREAKPOINT_PRIORITY) == part_end // 16


def test_openais_latest_n_rule_and_lifetimes_covering_earlier_segments(fresh):
    _client, sdk = fresh
    parts = [marked(f"Chapter {i}. " * 6, "12h" if i == 4 else None) for i in range(5)]
    out = sdk.chat.completions.create(
        model=MODEL, max_completion_tokens=1, prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}])
    info = kvflow_of(out)["prompt_cache"]
    assert info["ignored"] == ["messages[1].content[0].prompt_cache_breakpoint"]  # the latest 4 are written
    assert [b["field"] for b in info["breakpoints"]] == [
        f"messages[1].content[{j}].prompt_cache_breakpoint" for j in (1, 2, 3, 4)]
    # the last breakpoint (12h) covers every segment before it
    assert {s["duration_s"] for s in info["retained"]} == {43200.0}
    implicit = sdk.chat.completions.create(
        model=MODEL, max_completion_tokens=1,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}])
    info = kvflow_of(implicit)["prompt_cache"]
    assert len(info["ignored"]) == 2 and next(b["kind"] for b in info["breakpoints"]) == "implicit"
    assert [b["ttl_s"] for b in info["breakpoints"]] == [1800.0, 1800.0, 1800.0, 43200.0]


def test_cache_control_blocks_map_the_same_way_and_kv_retention_wins(fresh):
    client, _ = fresh
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM,
                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "user", "content": "Hi", "cache_control": {"type": "ephemeral"}}]}
    info = client.post("/v1/chat/completions", json=body).json()["kvflow"]["prompt_cache"]
    system_end = len(f"<|system|>\n{SYSTEM}\n".encode())
    user_end = system_end + len(b"<|user|>\nHi\n")
    assert [(b["field"], b["position"], b["ttl_s"]) for b in info["breakpoints"]] == [
        ("messages[0].content[0].cache_control", system_end, 3600.0),  # the implicit one falls here too: one
        ("messages[1].cache_control", user_end, 300.0)]
    assert info["retained"][0] == {"start": 0, "end": system_end // 16 * 16, "priority": BREAKPOINT_PRIORITY,
                                   "duration_s": 3600.0}
    own = {**body, "kv_retention": {"token_ranges": [{"start": 0, "end": 32, "priority": 70}]}}
    info = client.post("/v1/chat/completions", json=own).json()["kvflow"]["prompt_cache"]
    assert info == {"source": "kv_retention", "breakpoints": [], "retained": [],
                    "ignored": ["messages[0].content[0].cache_control", "messages[1].cache_control"]}


def test_without_marks_nothing_changes_and_explicit_mode_without_breakpoints_retains_nothing(fresh):
    client, sdk = fresh
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    out = sdk.chat.completions.create(model=MODEL, max_completion_tokens=1, messages=messages,
                                      prompt_cache_key="tenant-doc-7")
    assert "prompt_cache" not in kvflow_of(out)
    out = sdk.chat.completions.create(model=MODEL, max_completion_tokens=1, messages=messages,
                                      prompt_cache_options={"mode": "explicit"})
    assert kvflow_of(out)["prompt_cache"] == {"source": "prompt_cache", "breakpoints": [], "ignored": [],
                                              "retained": []}
    assert set(priorities(client)) == {35}


def test_a_stream_reports_the_marks_first_and_exact_cached_tokens_last(fresh):
    _client, sdk = fresh
    messages = [{"role": "system", "content": [marked(SYSTEM)]}, {"role": "user", "content": "Rule one?"}]
    first = sdk.chat.completions.create(model=MODEL, max_completion_tokens=2, messages=messages)
    chunks = list(sdk.chat.completions.create(model=MODEL, max_completion_tokens=2, messages=messages, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].model_extra["kvflow"]["prompt_cache"]["retained"][0]["priority"] == BREAKPOINT_PRIORITY
    prompt = first.usage.prompt_tokens
    # the whole prompt was cached but its last token, recomputed for the first logits (whole blocks only)
    assert chunks[-1].usage.prompt_tokens == prompt
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16


@pytest.mark.parametrize(("patch", "status", "fragment"), [
    ({"ttl": "7m"}, 422, "messages.0.content.list[ContentPart].0.prompt_cache_breakpoint.ttl"),
    ({"mode": "implicit"}, 422, "prompt_cache_breakpoint.mode"),
    ({"extra": 1}, 422, "prompt_cache_breakpoint.extra"),
])
def test_bad_breakpoints_are_refused_naming_the_field(fresh, patch, status, fragment):
    client, _ = fresh
    part = {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", **patch}}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == status and fragment in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}, "prompt_cache_breakpoint": {"mode": "explicit"}}]}]},
     400, "messages[0].content[0].prompt_cache_breakpoint: a breakpoint must mark a text part"),
    ({"messages": [{"role": "user", "content": "x", "cache_control": {"type": "persistent"}}]}, 422,
     "cache_control.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                 "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]},
     422, "cache_control.ttl"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": "k" * 257}, 422, "prompt_cache_key"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_cache_options": {"mode": "sometimes"}}, 422,
     "prompt_cache_options.mode"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_cache_retention": "forever"}, 422,
     "prompt_cache_retention"),
])
def test_bad_prompt_cache_fields_are_refused_naming_the_field(fresh, body, status, fragment):
    client, _ = fresh
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.json()
    assert fragment in r.json()["error"]["message"], r.json()
    assert set(priorities(client)) <= {35}  # nothing half-applied: nothing ran


def _flood_then_reuse(use_marks: bool) -> tuple[int, int]:
    """A marked (or unmarked) system prompt, a flood of one-off prompts through a small cache, the
    system prompt again: its prompt tokens and how many came from the cache."""
    client, sdk = _fleet(48)  # 768 tokens
    try:
        system = [marked(SYSTEM, "30m")] if use_marks else SYSTEM
        sdk.chat.completions.create(model=MODEL, max_completion_tokens=1, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "First question."}])
        for i in range(12):  # one-off prompts of 18 blocks each, unmarked
            client.post("/v1/completions", json={"prompt": f"one-off {i:03d} " + "z" * 280, "max_tokens": 1})
        again = sdk.chat.completions.create(model=MODEL, max_completion_tokens=1, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Second question."}])
        return again.usage.prompt_tokens, again.usage.prompt_tokens_details.cached_tokens
    finally:
        client.__exit__(None, None, None)
        client.node.close()  # type: ignore[attr-defined]


def test_a_flood_of_one_off_prompts_evicts_the_unmarked_system_prompt_and_not_the_marked_one():
    system_blocks = len(f"<|system|>\n{SYSTEM}\n".encode()) // 16
    _, cached = _flood_then_reuse(use_marks=True)
    assert cached == system_blocks * 16
    _, cached = _flood_then_reuse(use_marks=False)
    assert cached == 0


def test_the_answer_is_plain_json_the_sdk_parses(fresh):
    client, _ = fresh
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [marked("Hi")]}],
                                                  "max_tokens": 1})
    assert r.status_code == 200
    json.dumps(r.json()["kvflow"]["prompt_cache"])


def test_langchains_openai_chat_model_sends_cache_control_blocks_that_retain(fresh):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    client, _ = fresh
    llm = ChatOpenAI(model=MODEL, base_url="http://testserver/v1", api_key="unused", http_client=client,
                     max_tokens=2, max_retries=0)
    system = SystemMessage(content=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral",
                                                                                       "ttl": "1h"}}])
    first = llm.invoke([system, HumanMessage(content="Rule one?")])
    end = len(f"<|system|>\n{SYSTEM}\n".encode()) // 16 * 16
    assert priorities(client).count(BREAKPOINT_PRIORITY) == end // 16
    again = llm.invoke([system, HumanMessage(content="Rule two?")])
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    shared = len(f"<|system|>\n{SYSTEM}\n<|user|>\nRule ".encode())  # both prompts' common prefix
    assert again.usage_metadata["input_token_details"]["cache_read"] == shared // 16 * 16
