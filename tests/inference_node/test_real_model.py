"""The real SmolLM2-135M-Instruct (``kvflow model pull smollm2-135m``) on the node, against
transformers' ``LlamaForCausalLM`` on the same folder: logits, greedy tokens, the reference answer.

fp32 on the CPU, transformers with its plain ("eager") attention. Measured, the node's prefill
logits differ from transformers' by at most 6.4e-5 at a logit scale of ~38 (a relative 1.7e-6:
30 layers of fp32 sums in another order); ``ATOL`` (5e-4) allows 8x that. The smallest top-2
margin over the 64 greedy steps below was 1.0e-2, 150 times the difference: the greedy tokens must
be identical, and are.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference_node.model.llama import KVPool, LlamaModel, SeqBatchItem, copy_block
from openai_api.chat import load_chat_template
from openai_api.tokenizers import load_tokenizer

from .conftest import generate, make_node

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")
ATOL = 5e-4
STORY = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Write a short story about a robot who learns to paint."}]
FRANCE = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32,
                                                         attn_implementation="eager").eval()


def _chat_ids(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    text = load_chat_template(folder).render(messages, add_generation_prompt=True)
    return load_tokenizer(folder).encode(text, add_special_tokens=False)


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, EOS or not (its own KV cache)."""
    out: list[int] = []
    with torch.no_grad():
        o = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(o.logits[0, -1].argmax()))
            o = hf(torch.tensor([[out[-1]]]), past_key_values=o.past_key_values, use_cache=True)
    return out


def test_prefill_and_decode_logits_equal_transformers_also_after_a_host_round_trip(smollm2_dir, reference):
    ours = LlamaModel.load_hf(smollm2_dir)
    assert ours.cfg.rope_theta == 100000.0 and ours.cfg.head_dim == 64 and ours.cfg.tie_word_embeddings
    ids = _chat_ids(smollm2_dir, STORY)
    cont = _greedy(reference, ids, 6)
    with torch.no_grad():
        want = reference(torch.tensor([ids + cont])).logits[0].float()
    pool = KVPool(ours.cfg, 8, 16, CPU, torch.float32)
    [got] = ours.forward([SeqBatchItem(ids, 0, [0, 1, 2])], pool, all_logits=True)
    torch.testing.assert_close(got, want[:len(ids)], rtol=0, atol=ATOL)
    # The prompt's two full blocks go to the host tier and come back elsewhere; decoding goes on.
    host = KVPool(ours.cfg, 2, 16, CPU, torch.float32)
    copy_block(pool, 0, host, 1)
    copy_block(pool, 1, host, 0)
    copy_block(host, 1, pool, 5)
    copy_block(host, 0, pool, 6)
    pool.k[:, :2].zero_()
    pool.v[:, :2].zero_()
    table = [5, 6, 2]
    for i, tok in enumerate(cont):
        [step] = ours.forward([SeqBatchItem([tok], len(ids) + i, table)], pool)
        torch.testing.assert_close(step, want[len(ids) + i], rtol=0, atol=ATOL)


def test_greedy_64_tokens_through_the_engine_equal_transformers_cold_and_from_the_cache(smollm2_dir, reference):
    ids = _chat_ids(smollm2_dir, STORY)
    want = _greedy(reference, ids, 64)
    node = make_node(model_dir=str(smollm2_dir), num_blocks=32, block_size=16)
    try:
        cold, out_cold = generate(node, ids, 64, ignore_eos=True, request_id="cold")
        warm, out_warm = generate(node, ids, 64, ignore_eos=True, request_id="warm")
    finally:
        node.close()
    assert cold == want
    assert warm == want
    # every full block cached; of a prompt of whole blocks the last token is computed again
    assert (out_cold.cached_tokens, out_warm.cached_tokens) == (0, min(len(ids) // 16 * 16, len(ids) - 1))


def _as_transformers_writes_it(folder: Path, to: Path) -> Path:
    """The folder with the tokenizer config transformers' GGUF import writes: EOS ``<|im_start|>``."""
    import json
    import shutil

    to.mkdir()
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            (to / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, to / f.name)
    config = json.loads((to / "tokenizer_config.json").read_text())
    (to / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_start|>"}))
    return to


@pytest.mark.parametrize("layout", ["pulled", "tokenizer_config_eos_wrong"])
def test_the_reference_question_is_answered_and_ends_at_im_end(smollm2_dir, tmp_path, layout):
    folder = smollm2_dir if layout == "pulled" else _as_transformers_writes_it(smollm2_dir, tmp_path / "m")
    node = make_node(model_dir=str(folder), num_blocks=16, block_size=16)
    try:
        tokens, out = generate(node, _chat_ids(folder, FRANCE), 64, request_id="france")
        text = node.tokenizer.decode(tokens)
    finally:
        node.close()
    assert text == "The capital of France is Paris."
    assert tokens[-1] == 2 and out.finish_reason == "stop"  # <|im_end|>, the generation config's EOS
    assert node.tokenizer.eos_token_ids == (2,)
