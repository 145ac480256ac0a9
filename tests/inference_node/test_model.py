"""The model over the paged pool: cached prefixes, the engine, Hugging Face weights, tiers."""

from __future__ import annotations

import json

import pytest
import torch

from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange
from inference_node.model.llama import KVPool, LlamaModel, ModelConfig, SeqBatchItem
from inference_node.node import PRESETS
from openai_api.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

from .conftest import generate, make_node

CPU = torch.device("cpu")


def test_a_cached_prefix_gives_the_same_logits_as_a_full_prefill():
    cfg = PRESETS["tiny"]
    model = LlamaModel.random(cfg, seed=3)
    tokens = [(i * 7) % 250 for i in range(90)]
    cold = KVPool(cfg, 16, 16, CPU, torch.float32)
    full = model([SeqBatchItem(tokens, 0, [3, 9, 1, 4, 12, 7])], cold, all_logits=True)[0]
    warm = KVPool(cfg, 16, 16, CPU, torch.float32)
    table = [5, 2, 8, 11, 0, 6]  # different physical blocks: only the block table matters
    model([SeqBatchItem(tokens[:64], 0, table[:4])], warm)
    part = model([SeqBatchItem(tokens[64:], 64, table)], warm, all_logits=True)[0]
    torch.testing.assert_close(part, full[64:], rtol=1e-4, atol=1e-5)


def test_batched_decode_equals_one_at_a_time():
    cfg = PRESETS["tiny"]
    model = LlamaModel.random(cfg, seed=4)
    pool = KVPool(cfg, 16, 16, CPU, torch.float32)
    a, b = list(range(20)), list(range(100, 140))
    model([SeqBatchItem(a, 0, [0, 1])], pool)
    model([SeqBatchItem(b, 0, [2, 3, 4])], pool)
    together = model([SeqBatchItem([5], 20, [0, 1]), SeqBatchItem([6], 40, [2, 3, 4])], pool)
    alone = model([SeqBatchItem([6], 40, [2, 3, 4])], pool)
    torch.testing.assert_close(together[1], alone[0], rtol=1e-4, atol=1e-5)


def test_greedy_generation_is_the_same_with_and_without_reuse_and_reports_cached_tokens(node):
    prompt = [(i * 13) % 250 for i in range(70)]  # 4 full blocks of 16 and a partial one
    cold_tokens, cold = generate(node, prompt, 8, request_id="a")
    warm_tokens, warm = generate(node, prompt, 8, request_id="b")
    assert warm_tokens == cold_tokens
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 64)
    assert warm.prompt_tokens == 70 and warm.completion_tokens == 8 and warm.finish_reason == "length"
    # A fully cached prompt still computes its last token (its logits give the first output).
    exact = prompt[:64]
    generate(node, exact, 2, request_id="c")
    _tokens, out = generate(node, exact, 2, request_id="d")
    assert out.cached_tokens == 63


def test_seeded_sampling_is_reproducible(node):
    prompt = list(range(40))
    a, _ = generate(node, prompt, 10, temperature=1.0, seed=7, request_id="s1")
    b, _ = generate(node, prompt, 10, temperature=1.0, seed=7, request_id="s2")
    c, _ = generate(node, prompt, 10, temperature=1.0, seed=8, request_id="s3")
    assert a == b and a != c


def test_a_request_the_engine_cannot_serve_is_refused_and_the_engine_carries_on(node):
    # A seed beyond 64 bits (the HTTP schema refuses it; the engine must not trust that).
    tokens, out = generate(node, list(range(40)), 4, temperature=1.0, seed=1 << 70, request_id="bad-seed")
    assert tokens == [] and out.finish_reason == "error" and out.error.startswith("request refused: ")
    assert node.engine.fatal is None and node.core.active_requests == 0
    tokens, out = generate(node, list(range(40)), 4, request_id="after")
    assert len(tokens) == 4 and out.error is None


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 2.0])
def test_any_positive_temperature_samples_without_crashing(node, temperature):
    # found by the fuzz test: logits / 1e-300 overflowed to inf, softmax gave nan, the engine died
    tokens, out = generate(node, list(range(40)), 3, temperature=temperature, seed=1, request_id=f"t{temperature}")
    assert len(tokens) == 3 and out.error is None and node.engine.fatal is None
    if temperature < 1e-10:  # as good as greedy
        assert tokens == generate(node, list(range(40)), 3, request_id=f"g{temperature}")[0]


def test_finish_reason_is_stop_only_for_an_eos_that_counts(node, monkeypatch):
    prompt = list(range(40))
    tokens, _ = generate(node, prompt, 3, request_id="probe")
    if tokens[2] in tokens[:2]:
        pytest.skip("the greedy continuation repeats a token")  # deterministic: the seeded tiny model
    monkeypatch.setattr(node.engine.tokenizer, "eos_token_ids", (tokens[2],))  # the 3rd token is now EOS
    got, out = generate(node, prompt, 3, ignore_eos=True, request_id="ignore")
    assert got == tokens and out.finish_reason == "length"  # an ignored EOS is just a token
    got, out = generate(node, prompt, 8, request_id="honour")
    assert got == tokens and out.finish_reason == "stop"


def test_offload_and_onboard_move_the_real_tensors():
    n = make_node(num_blocks=8, host_blocks=16)
    try:
        keep = list(range(64))  # 4 blocks, priority 60: offloaded when evicted
        ret = KvCacheRetentionConfig((TokenRange(0, None, 60),))
        first, _ = generate(n, keep, 4, retention=ret, request_id="k1")
        for i in range(3):  # push it out of the 8 GPU blocks
            generate(n, [200 + i] * 64, 2, request_id=f"p{i}")
        assert n.core.match_prefix(Prompt.from_tokens(keep, 16))[1] > 0, "some of it is on the host now"
        again, out = generate(n, keep, 4, request_id="k2")
        assert out.cached_tokens == 63 and again == first
        assert n.engine.stats.copies > 0
        assert n.core.stats.onboards > 0 and sum(n.core.stats.offloads_by_priority.values()) > 0
    finally:
        n.close()


def test_saving_in_hugging_face_format_and_loading_back_gives_the_same_outputs(tmp_path, node):
    node.model.save_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    loaded = LlamaModel.load_hf(tmp_path)
    assert loaded.cfg == node.model.cfg.__class__.from_hf(cfg, name=tmp_path.name)
    for (n1, p1), (n2, p2) in zip(node.model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2
        torch.testing.assert_close(p1, p2)
    prompt = list(range(50))
    expected, _ = generate(node, prompt, 6, request_id="x1")
    other = make_node(model_dir=str(tmp_path))
    try:
        got, _ = generate(other, prompt, 6, request_id="x2")
        assert got == expected
    finally:
        other.close()


def test_a_tokenizer_json_next_to_the_weights_is_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "kv": 3, "flow": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    t = load_tokenizer(tmp_path)
    assert isinstance(t, HFTokenizer)
    assert t.encode("hello kv flow nope") == [2, 3, 4, 0]
    assert t.eos_token_ids == (1,)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert ByteTokenizer().encode("é") == [0xC3, 0xA9]


def test_eos_comes_from_the_generation_config_then_the_model_config_then_the_tokenizer_config(tmp_path):
    """As transformers' generate takes it (an int or a list); the tokenizer config comes last: a
    converter that wrote it wrong (SmolLM2's ``<|im_start|>`` named EOS) changes nothing."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 3, "hi": 4}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_start|>"}}))
    assert load_tokenizer(tmp_path).eos_token_ids == (1,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_tokenizer(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3, 2]}))
    assert load_tokenizer(tmp_path).eos_token_ids == (2, 3)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))  # none there
    assert load_tokenizer(tmp_path).eos_token_ids == (2,)


def test_any_of_several_eos_ids_ends_a_sequence(node, monkeypatch):
    prompt = list(range(40))
    tokens, out = generate(node, prompt, 4, request_id="probe2")
    assert out.finish_reason == "length"
    monkeypatch.setattr(node.engine.tokenizer, "eos_token_ids", (299, tokens[0]))  # the second of two
    got, out = generate(node, prompt, 8, request_id="second")
    assert got == tokens[:1] and out.finish_reason == "stop"


def test_a_non_llama_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="Llama-family"):
        LlamaModel.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    with pytest.raises(ValueError, match="model_type 'gemma'"):
        LlamaModel.load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LlamaModel.load_hf(tmp_path / "missing")


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3' needs low_freq_factor"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "qwen2"}, "model_type 'qwen2'"),
    ({"head_dim": 4}, "weights do not match"),  # a head_dim is honoured: these weights are not its shapes
    ({"intermediate_size": 7}, "weights do not match"),  # the config no longer describes the weights
])
def test_checkpoints_this_model_cannot_compute_are_refused_in_one_line(tmp_path, node, change, message):
    node.model.save_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message) as info:
        LlamaModel.load_hf(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_in_bf16_a_reused_prompt_gives_the_same_tokens():
    n = make_node(device="cuda", num_blocks=32, host_blocks=32)
    try:
        assert n.device.type == "cuda" and n.model.embed_tokens.weight.dtype == torch.bfloat16
        prompt = list(range(80))  # 5 full blocks of 16: all cached the second time, but the last
        a, cold = generate(n, prompt, 8, request_id="g1")  # token is computed again (its logits
        b, warm = generate(n, prompt, 8, request_id="g2")  # give the first output), as on the CPU
        assert a == b and warm.cached_tokens == 79 and cold.cached_tokens == 0
    finally:
        n.close()


def test_model_config_validates_shapes():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig(num_attention_heads=8, num_key_value_heads=3)
