"""The node's model against a reference implementation: transformers' ``LlamaForCausalLM`` on the
same weights, loaded by the node from the folder transformers wrote.

Every comparison runs in fp32 on the CPU, transformers with its plain ("eager") attention. The
two implementations do the same arithmetic in different orders (the node projects all new tokens
of a ragged batch together and attends per sequence over keys gathered from its block pool;
transformers runs one padded sequence), so logits agree to rounding, not bit for bit:
measured, the largest difference is 2.4e-7 (4 fp32 ulps at |logit| ~0.7, the random models'
scale: weights of std 0.02). ``ATOL`` (2e-6, ~30 ulps) leaves room for another CPU's kernels; a
wrong RoPE base, rotary pairing, head dimension or a mask off by one moves logits by 1e-3 or more
(``test_a_wrong_rope_base_is_caught``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference_node.model.config import ModelConfig
from inference_node.model.llama import KVPool, LlamaModel, SeqBatchItem, copy_block

CPU = torch.device("cpu")
BS = 8
ATOL = 2e-6
TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}
#: Configurations the node computes exactly, in the layouts real checkpoints use.
CONFIGS = {
    "default": {"rope_theta": 10000.0},
    "theta_1e5": {"rope_theta": 100000.0},  # SmolLM2's base: transformers 5 writes it in rope_parameters
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}},
    "head_dim": {"rope_theta": 10000.0, "head_dim": 32},  # 4 heads of 32 on a hidden size of 64
    "tied_mha": {"rope_theta": 10000.0, "num_key_value_heads": 4, "tie_word_embeddings": True},
}


def _reference(tmp: Path, name: str, seed: int = 0) -> tuple[LlamaForCausalLM, LlamaModel]:
    """A seeded random transformers model saved as transformers writes it, and the node's model
    loaded from that folder."""
    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**{**TINY, **CONFIGS[name]}, attn_implementation="eager")
    hf = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # transformers initializes norms at 1: make them matter
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    folder = tmp / name
    hf.save_pretrained(folder)
    return hf, LlamaModel.load_hf(folder)


def _hf_logits(hf: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _pool(model: LlamaModel, blocks: int = 32) -> KVPool:
    return KVPool(model.cfg, blocks, BS, CPU, torch.float32)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_logits_equal_transformers(tmp_path, name):
    hf, ours = _reference(tmp_path, name)
    tokens = _tokens(45, 1)
    [got] = ours.forward([SeqBatchItem(tokens, 0, list(range(6)))], _pool(ours), all_logits=True)
    want = _hf_logits(hf, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["default", "llama3", "head_dim"])
def test_decode_logits_step_by_step_equal_transformers(tmp_path, name):
    hf, ours = _reference(tmp_path, name)
    tokens = _tokens(40, 2)
    pool, table = _pool(ours), list(range(5))
    want = _hf_logits(hf, tokens)
    [first] = ours.forward([SeqBatchItem(tokens[:10], 0, table)], pool)
    torch.testing.assert_close(first, want[9], rtol=0, atol=ATOL)
    for p in range(10, 40):  # one token at a time, its keys and values from the pool
        [step] = ours.forward([SeqBatchItem([tokens[p]], p, table)], pool)
        torch.testing.assert_close(step, want[p], rtol=0, atol=ATOL)


def test_a_prefix_from_the_cache_gives_the_reference_logits_after_reuse_and_a_host_round_trip(tmp_path):
    hf, ours = _reference(tmp_path, "llama3")
    a = _tokens(24, 3)  # three full blocks
    b = a[:16] + _tokens(13, 4)  # shares two of them, then its own
    pool = _pool(ours)
    ours.forward([SeqBatchItem(a, 0, [0, 1, 2])], pool)
    [reused] = ours.forward([SeqBatchItem(b[16:], 16, [0, 1, 5, 6])], pool, all_logits=True)
    want = _hf_logits(hf, b)
    torch.testing.assert_close(reused, want[16:], rtol=0, atol=ATOL)
    # The two shared blocks go to the host tier and come back into other GPU slots.
    host = KVPool(ours.cfg, 4, BS, CPU, torch.float32)
    copy_block(pool, 0, host, 3)
    copy_block(pool, 1, host, 2)
    pool.k.zero_()
    pool.v.zero_()
    copy_block(host, 3, pool, 9)
    copy_block(host, 2, pool, 11)
    [back] = ours.forward([SeqBatchItem(b[16:], 16, [9, 11, 12, 13])], pool, all_logits=True)
    torch.testing.assert_close(back, want[16:], rtol=0, atol=ATOL)


def test_a_ragged_batch_gives_each_sequence_its_reference_logits(tmp_path):
    hf, ours = _reference(tmp_path, "head_dim")
    pool = _pool(ours, 40)
    s1, s2, s3 = _tokens(30, 5), _tokens(9, 6), _tokens(21, 7)
    ours.forward([SeqBatchItem(s3[:20], 0, [20, 21, 22])], pool)  # s3's prefix is in the pool
    got = ours.forward([SeqBatchItem(s1, 0, [0, 1, 2, 3]),  # a prefill from scratch
                        SeqBatchItem(s2, 0, [10, 11]),  # a short one
                        SeqBatchItem(s3[20:], 20, [20, 21, 22])],  # a decode step
                       pool, all_logits=True)
    for out, seq, start in zip(got, (s1, s2, s3), (0, 0, 20), strict=True):
        torch.testing.assert_close(out, _hf_logits(hf, seq)[start:], rtol=0, atol=ATOL)


def test_transformers_4_and_5_layouts_load_the_same_model(tmp_path):
    _, ours = _reference(tmp_path, "llama3")
    written = json.loads((tmp_path / "llama3" / "config.json").read_text())
    assert "rope_parameters" in written  # transformers 5 wrote it: the base inside rope_parameters
    v4 = {k: v for k, v in written.items() if k != "rope_parameters"}
    params = written["rope_parameters"]
    v4["rope_theta"] = params["rope_theta"]
    v4["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    assert ModelConfig.from_hf(v4, "llama3") == ModelConfig.from_hf(written, "llama3") == ours.cfg
    assert ours.cfg.rope_theta == 500000.0 and ours.cfg.rope_llama3 is not None


def test_a_wrong_rope_base_is_caught(tmp_path):
    """The bug a transformers-5 config once met (RoPE base 10,000 for 100,000): the comparison
    above fails by orders of magnitude more than its tolerance."""
    hf, ours = _reference(tmp_path, "theta_1e5")
    wrong = LlamaModel(ModelConfig(**{**ours.cfg.__dict__, "rope_theta": 10000.0}))
    wrong.load_state_dict(ours.state_dict())
    tokens = _tokens(45, 1)
    [got] = wrong.forward([SeqBatchItem(tokens, 0, list(range(6)))], _pool(wrong), all_logits=True)
    assert (got - _hf_logits(hf, tokens)).abs().max() > 50 * ATOL


def test_bf16_on_the_cpu_is_fp32_arithmetic_over_bf16_weights_and_keys(tmp_path):
    """``--dtype bfloat16`` on the CPU keeps weights and keys/values in bf16 and computes in fp32
    (``native.compute_dtype``): its logits are transformers' fp32 logits on the bf16-rounded
    weights, up to the rounding of the keys and values (one bf16 step, ~0.4 %, each): measured 5.6e-4 at
    most, at logits of ~0.7."""
    hf, ours = _reference(tmp_path, "llama3")
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ours = ours.to(torch.bfloat16)
    tokens = _tokens(30, 8)
    pool, table = KVPool(ours.cfg, 32, BS, CPU, torch.bfloat16), list(range(4))
    want = _hf_logits(hf, tokens)
    [first] = ours.forward([SeqBatchItem(tokens[:10], 0, table)], pool)
    assert first.dtype == torch.float32
    torch.testing.assert_close(first, want[9], rtol=0, atol=1e-3)
    for p in range(10, 30):
        [step] = ours.forward([SeqBatchItem([tokens[p]], p, table)], pool)
        torch.testing.assert_close(step, want[p], rtol=0, atol=1e-3)
    # fp32 keys and values instead: the logits are the fp32 reference's to fp32 rounding
    exact = LlamaModel.load_hf(tmp_path / "llama3")
    exact.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    [again] = exact.forward([SeqBatchItem(tokens[:10], 0, table)], _pool(exact))
    torch.testing.assert_close(again, want[9], rtol=0, atol=ATOL)
