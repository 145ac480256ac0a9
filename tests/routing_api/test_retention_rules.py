"""Fleet retention rules and tenant limits (``routing_api.retention``), pure: the seed preset's
ranges at exact token positions, rule matching, a policy file's errors naming the field, the
priority cap, and two tenants, one trying to pin everything at 100, under a retained-share limit."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from eventbus.hashing import prompt_hash_heads
from openai_api.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from openai_api.schemas import ChatCompletionRequest
from routing_api.retention import (
    SEED,
    Match,
    RetainedLedger,
    Retention,
    RetentionPolicy,
    TenantLimit,
    cap_priority,
    load_policy,
    rule_retention,
)

TEMPLATE = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
SYSTEM = "Policy. " * 20


def encode(text: str) -> list[int]:
    return list(text.encode())  # the byte model's tokenizer


def chat(messages: list[dict], tools: list | None = None) -> tuple[ChatCompletionRequest, list[int]]:
    body = ChatCompletionRequest.model_validate({"messages": messages, **({"tools": tools} if tools else {})})
    return body, encode(TEMPLATE.render(body.chat_messages(), tools=body.chat_tools()))


def test_the_seed_preset_splits_a_conversation_by_role_at_whole_blocks():
    body, prompt = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question " * 3},
                         {"role": "assistant", "content": "First answer " * 3}, {"role": "user", "content": "Next?"}])
    system_end = len(f"<|system|>\n{SYSTEM}\n")
    history_end = system_end + len(f"<|user|>\n{'First question ' * 3}\n<|assistant|>\n{'First answer ' * 3}\n")
    got = rule_retention(SEED, body, TEMPLATE, encode, prompt, 16)
    s, h = system_end // 16 * 16, history_end // 16 * 16
    assert got == {"token_ranges": [{"start": 0, "end": s, "priority": 100, "duration_s": 3600.0},
                                    {"start": s, "end": h, "priority": 50, "duration_s": 30.0},
                                    {"start": h, "end": None, "priority": 0, "duration_s": None}],
                   "decode_priority": 30, "decode_duration_s": 10.0}


def test_a_one_off_prompt_and_a_completion_are_all_rest():
    body, prompt = chat([{"role": "user", "content": "Just once."}])
    assert rule_retention(SEED, body, TEMPLATE, encode, prompt, 16)["token_ranges"] == [
        {"start": 0, "end": None, "priority": 0, "duration_s": None}]
    assert rule_retention(SEED, None, None, encode, encode("a completion"), 16)["token_ranges"] == [
        {"start": 0, "end": None, "priority": 0, "duration_s": None}]


def test_rules_match_in_order_by_model_tenant_tools_and_length():
    short = SEED.model_copy(update={"name": "short", "match": Match(max_prompt_tokens=100)})
    tools = SEED.model_copy(update={"name": "tools", "match": Match(tools=True, tenant="acme")})
    policy = RetentionPolicy(rules=(short, tools, SEED.model_copy(update={"match": Match(model="m")})))
    assert policy.rule_for("m", None, False, 50).name == "short"
    assert policy.rule_for("m", "acme", True, 500).name == "tools"
    assert policy.rule_for("m", "other", True, 500).name == "seed"
    assert policy.rule_for("x", "other", True, 500) is None


def test_a_policy_file_with_the_preset_and_tenants_and_its_errors(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"rules": ["seed"], "tenants": {"acme": {"max_priority": 60}}}))
    policy = load_policy(str(path))
    assert policy.rules == (SEED,) and policy.limit_for("acme").max_priority == 60
    assert policy.limit_for("other") == TenantLimit() and policy.limits_anything
    assert load_policy(None) == RetentionPolicy() and not load_policy("seed").limits_anything
    path.write_text(json.dumps({"rules": [{"name": "x", "system": {"priority": 101}}]}))
    with pytest.raises(ValidationError, match=r"rules\.0\.system\.priority"):
        load_policy(str(path))
    path.write_text(json.dumps({"tenants": {"acme": {"max_retained_share": 2}}}))
    with pytest.raises(ValidationError, match="max_retained_share"):
        load_policy(str(path))


def test_the_priority_cap_lowers_and_says_so():
    r = Retention("kv_retention", {"token_ranges": [{"start": 0, "end": 32, "priority": 100, "duration_s": None},
                                                    {"start": 32, "end": None, "priority": 20, "duration_s": None}],
                                   "decode_priority": 90})
    cap_priority(r, TenantLimit(max_priority=60), "acme")
    assert [t["priority"] for t in r.body["token_ranges"]] == [60, 20] and r.body["decode_priority"] == 60
    assert r.lowered == ["priority capped at 60, tenant acme's max_priority"]


def test_two_tenants_one_pinning_everything_cannot_take_more_than_its_share():
    ledger = RetainedLedger(clock=lambda: 0.0)
    greedy, fair = TenantLimit(max_retained_share=0.25), TenantLimit(max_retained_share=0.25)
    capacity, bs = 64, 16
    held = []
    for i in range(6):  # 6 prompts of 8 blocks, all pinned at 100: 48 blocks wanted, 16 allowed
        tokens = [i] * 128
        r = Retention("kv_retention", {"token_ranges": [{"start": 0, "end": None, "priority": 100,
                                                         "duration_s": None}]})
        ledger.admit(r, greedy, "greedy", "n1", capacity, prompt_hash_heads(tokens, bs, cache_salt="greedy"), bs)
        held.append((r.body["token_ranges"], bool(r.lowered)))
    assert ledger.held("greedy", "n1") == 16
    assert [h[1] for h in held] == [False, False, True, True, True, True]
    assert held[1][0][0]["end"] is None and held[2][0] == []  # the third finds no room at all
    # the other tenant's share is its own
    r = Retention("kv_retention", {"token_ranges": [{"start": 0, "end": 64, "priority": 90, "duration_s": 5}]})
    ledger.admit(r, fair, "fair", "n1", capacity, prompt_hash_heads([7] * 64, bs, cache_salt="fair"), bs)
    assert not r.lowered and ledger.held("fair", "n1") == 4


def test_a_cut_keeps_the_earliest_blocks_and_expired_blocks_free_room():
    now = [0.0]
    ledger = RetainedLedger(clock=lambda: now[0])
    limit = TenantLimit(max_retained_share=0.1)  # 10 of 100 blocks
    first = Retention("kv_retention", {"token_ranges": [{"start": 0, "end": 96, "priority": 80, "duration_s": 10}]})
    ledger.admit(first, limit, "t", "n", 100, prompt_hash_heads(list(range(96)), 16), 16)
    second = Retention("kv_retention", {"token_ranges": [{"start": 0, "end": None, "priority": 80,
                                                          "duration_s": 10}]})
    ledger.admit(second, limit, "t", "n", 100, prompt_hash_heads([5] * 160, 16), 16)
    assert second.body["token_ranges"] == [{"start": 0, "end": 64, "priority": 80, "duration_s": 10}]
    assert "tokens from 64 keep the default priority" in second.lowered[0]
    now[0] = 11.0  # both expired
    assert ledger.held("t", "n") == 0


def test_a_database_without_the_keys_table_costs_the_key_not_the_request():
    """A router on a database not upgraded to migration 0005: keys from this process, no 500."""
    import asyncio

    import asyncpg

    from routing_api.cache_keys import CacheKeys

    class Reader:
        async def _fetch(self, sql: str, *args: object) -> list:
            raise asyncpg.UndefinedTableError('relation "prompt_cache_keys" does not exist')

    keys = CacheKeys(Reader())  # type: ignore[arg-type]
    keys.local[("", "m", "k")] = "n1"
    assert asyncio.run(keys.lookup(None, "m", "k")) == "n1"
    assert asyncio.run(keys.lookup(None, "m", "other")) is None
    assert asyncio.run(keys.stats(None)) == [] and keys.read_failures == 3
