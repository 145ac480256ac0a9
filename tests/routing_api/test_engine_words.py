"""One retention in each engine's words (``routing_api.engine_words``), as the router sends it:
the body for a vLLM node read back by vLLM's own request model (0.33.0's, ``make engines``) into
the ``SamplingParams.extra_args`` that kvflow's plugin parses into the very retention decided;
SGLang's one priority per request; nothing for trtllm-serve (which refuses unknown fields); kvflow's
node unchanged; a client's own words never overwritten; the answer saying what the engine got."""

from __future__ import annotations

import json

import pytest

from eventbus.protocol import NodeStats, ProtocolError, decode_stats, encode
from routing_api.engine_words import in_words, request_priority
from routing_api.retention import Retention
from routing_api.routes.completions import _outgoing
from tests.bridge.engines import require

pytestmark = pytest.mark.unit

RETENTION = {"token_ranges": [{"start": 0, "end": 64, "priority": 100, "duration_s": 3600.0},
                              {"start": 64, "end": None, "priority": 20, "duration_s": None}],
             "decode_priority": 30, "decode_duration_s": 10.0}
CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": "hi"}], "max_tokens": 4,
        "kv_retention": RETENTION, "prompt_cache_retention": "24h"}


def _sent(source: str = "kv_retention") -> Retention:
    return Retention(source, RETENTION)


def _out(engine: str, body: dict | None = None, tenant: str | None = None, sent: Retention | None = None):
    raw = json.dumps(body or CHAT).encode()
    out = _outgoing(raw, tenant, sent if sent is not None else _sent(), engine, {}, {"x-kvflow-retention": "x"})
    answer: dict = {}
    assert out.amend is not None
    out.amend(answer)
    return json.loads(out.content), out.headers, answer["kvflow"]["router"]["retention"]


def test_vllm_with_the_plugin_reads_the_retention_through_its_own_request_model():
    require("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from kvflow_vllm.retention import parse_retention
    body, headers, said = _out("vllm+kvflow")
    assert not {"kv_retention", "prompt_cache_retention"} & set(body)  # kvflow's own words left out
    request = ChatCompletionRequest.model_validate(body)
    assert request.model_extra == {}  # nothing vLLM would only log as ignored
    extra = request.to_sampling_params(4, {}).extra_args
    assert parse_retention(extra["kv_retention"]) == parse_retention(RETENTION)
    assert (said["engine"], said["honoured"], said.get("notes")) == ("vllm+kvflow", "all", None)
    assert headers["x-kvflow-retention-engine"] == "vllm+kvflow; all"


def test_stock_vllm_gets_the_same_words_and_the_answer_says_they_are_not_honoured():
    body, headers, said = _out("vllm")
    assert json.loads(body["vllm_xargs"]["kv_retention"]) == RETENTION
    assert said["honoured"] == "none" and "kvflow's plugin" in said["notes"][0]
    assert headers["x-kvflow-retention-engine"] == "vllm; none"


def test_a_clients_own_vllm_xargs_are_kept_and_its_own_kv_retention_there_wins():
    own = {**CHAT, "vllm_xargs": {"other": 7}}
    body, _h, _s = _out("vllm+kvflow", own)
    assert body["vllm_xargs"]["other"] == 7 and json.loads(body["vllm_xargs"]["kv_retention"]) == RETENTION
    theirs = {**CHAT, "vllm_xargs": {"kv_retention": '{"decode_priority": 90}'}}
    body, _h, said = _out("vllm+kvflow", theirs)
    assert body["vllm_xargs"] == {"kv_retention": '{"decode_priority": 90}'}
    assert "sent as it is" in said["notes"][0]


def test_sglang_gets_one_priority_per_request_and_the_answer_says_what_it_cannot_do():
    body, headers, said = _out("sglang")
    assert body["priority"] == 100 and "kv_retention" not in body
    assert said["honoured"] == "part" and headers["x-kvflow-retention-engine"] == "sglang; part"
    assert any("not per token range" in n for n in said["notes"])
    assert any("no retention durations" in n for n in said["notes"])
    body, _h, said = _out("sglang", {**CHAT, "priority": 5})  # the client's own priority is theirs
    assert body["priority"] == 5 and "sent as it is" in said["notes"][0]
    assert request_priority({"token_ranges": [], "decode_priority": 60}) == 60
    assert request_priority({"token_ranges": [{"start": 0, "end": 8, "priority": 0}], "decode_priority": 35}) == 35


def test_trtllm_serve_gets_no_field_it_would_refuse():
    body, headers, said = _out("trtllm")
    assert body == {k: v for k, v in CHAT.items() if k not in ("kv_retention", "prompt_cache_retention")}
    assert headers["x-kvflow-retention-engine"] == "trtllm; none"
    assert said["honoured"] == "none" and "Python API" in said["notes"][0]


def test_kvflows_node_gets_the_body_byte_for_byte_unless_the_router_changed_the_retention():
    raw = json.dumps(CHAT).encode()
    out = _outgoing(raw, None, _sent(), "kvflow", {}, {})
    assert out.content == raw  # the node makes the same retention of the body itself
    ruled = Retention("rule", {"token_ranges": [{"start": 0, "end": 32, "priority": 100, "duration_s": None}]},
                      rule="seed")
    out = _outgoing(raw, None, ruled, "kvflow", {}, {})
    assert json.loads(out.content)["kv_retention"] == ruled.body
    assert _outgoing(raw, None, None, "kvflow", {}, {}).content == raw


def test_a_tenants_salt_and_an_unknown_engine():
    body, _h, said = _out("vllm+kvflow", tenant="acme")
    assert body["cache_salt"] == "acme"
    body, _h, said = _out("tgi")
    assert "kv_retention" not in body and said["honoured"] == "none" and "'tgi'" in said["notes"][0]
    # without any retention, an engine behind a bridge still gets none of kvflow's own fields
    assert in_words("trtllm", None, {"prompt_cache_options": {}}).drop == ("prompt_cache_options",)


def test_heartbeats_carry_the_engine_and_leave_it_out_for_kvflows_node():
    beat = NodeStats(schema_version=1, node_id="n", instance_id="i", url="http://x", model="m", block_size=16, ts=1.0,
                     capacity=[1, 0], used=[0, 0], active_requests=0, queued_requests=0, last_event_id=-1)
    assert b"engine" not in encode(beat) and decode_stats(encode(beat)).engine == "kvflow"
    import msgspec
    plugin = msgspec.structs.replace(beat, engine="vllm+kvflow")
    assert decode_stats(encode(plugin)).engine == "vllm+kvflow"
    with pytest.raises(ProtocolError, match="engine"):
        decode_stats(encode(beat)[:-1] + b',"engine":"VLLM PLUGIN"}')
