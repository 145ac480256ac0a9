"""The tokenizers' prefix cache: exactly ``tokenizers``' whole-text tokenization, bounded, and off
where a tokenizer's structure does not prove it exact.

Two small byte-level BPEs are trained here on whitespace-rich random text (so that their merges
span the places where a wrong cut would show: runs of spaces and newlines, apostrophes, digits):
GPT-2's structure (``ByteLevel`` with its regex) and Llama 3's (``Split`` with the cl100k regex,
then ``ByteLevel``, special tokens, a BOS template). Every property compares with the library on
the whole text. Most run twice: with the cache's real chunk and checkpoint sizes on long texts,
and with tiny ones (many cuts, many divergences) on short texts.
"""

from __future__ import annotations

import json
import random
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import openai_api.prefix_cache as pc
from openai_api.prefix_cache import CHUNK_CHARS
from openai_api.tokenizers import (
    CL100K_PATTERN,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    prefix_cache_blocker,
)

FRAGMENTS = [
    " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n", "\n ", " \n ", "  \n", "\t\n", "\u00a0", "\u3000", "\x1c",
    "'s", "'t", "'ll", "'re", "'", "''", "'S", "0", "7", "123", "4567", "3.14", ".", ",", "!", "?", "...", "-", "(",
    ")", "\"", "😀", "👍🏽", "é", "e\u0301", "ß", "中文", "日本", "Ω", "hello", "world", "the", " the", " cat",
    "don", "We", "x", "a", "b", "<|eot_id|>", "<|eot", "_id|>", "<|", "|>", "<|endoftext|>", "<|start_header_id|>",
]
KINDS = ["gpt2", "llama3", "gpt2_plain", "cl100k_plain"]
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|endoftext|>"]


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(n))


def _train(pre: Any, template: bool, specials: bool = True) -> Tokenizer:
    rng = random.Random(3)
    corpus = [_random_text(rng, 120) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=2500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS if specials else [], show_progress=False))
    if template:
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


@dataclass
class Pair:
    """A tokenizer.json: the cached tokenizer and the library's own, the reference."""

    path: Path
    ref: Tokenizer

    def cached(self, **kw: Any) -> HFTokenizer:
        tok = HFTokenizer(self.path, **kw)
        assert tok.prefix_cache_enabled, tok.prefix_cache_reason
        return tok

    def check(self, tok: HFTokenizer, text: str, special: bool = True) -> None:
        """One tokenization through the cache (the router's ``encode_compact``), as the library's."""
        want = self.ref.encode(text, add_special_tokens=special).ids
        got = tok.encode_compact(text, special)
        assert isinstance(got, array) and got.typecode == "I"
        assert got.tolist() == want, text


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    out = {}
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    cl100k = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(CL100K_PATTERN), "isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # with added tokens (the cut stays a longest added token away from the end) and without
    kinds = {"gpt2": (gpt2, False, True), "llama3": (cl100k, True, True), "gpt2_plain": (gpt2, False, False),
             "cl100k_plain": (cl100k, False, False)}
    for name, (pre, template, specials) in kinds.items():
        folder = tmp_path_factory.mktemp(name)
        tok = _train(pre, template, specials)
        tok.save(str(folder / "tokenizer.json"))
        out[name] = Pair(folder / "tokenizer.json", Tokenizer.from_file(str(folder / "tokenizer.json")))
    return out


@pytest.fixture(params=["real", "tiny"])
def sizes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The cache's chunk and checkpoint sizes: as shipped (texts of ~300–1,500 characters), or
    tiny (texts of tens of characters; a cut every few tokens). Yields the texts' minimum length."""
    if request.param == "tiny":
        monkeypatch.setattr(pc, "CHUNK_CHARS", 8)
        monkeypatch.setattr(pc, "CHECKPOINT_TOKENS", 3)
        yield 8
    else:
        yield CHUNK_CHARS + 40


fragment = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4))
spaces = st.lists(st.sampled_from([" ", "\n", "\t", "\r\n", "\r", "\u00a0", "\u2028", "\x0b"]), min_size=1,
                  max_size=6).map("".join)
piece = st.one_of(fragment, fragment, spaces)


TAILS = st.lists(piece, min_size=0, max_size=30).map("".join)
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])


def _head(data: st.DataObject, n: int) -> str:
    """A text of at least ``n`` characters, varied at its end (where the cut is)."""
    text = data.draw(st.lists(piece, min_size=1, max_size=30).map("".join))
    filler = data.draw(st.randoms(use_true_random=False))
    while len(text) < n:
        text = _random_text(filler, 40) + text
    return text


@pytest.mark.parametrize("kind", KINDS)
@PROPS
@given(data=st.data())
def test_a_chain_of_extensions_is_tokenized_as_the_whole_text(trained: dict[str, Pair], sizes: int, kind: str,
                                                              data: st.DataObject) -> None:
    pair = trained[kind]
    tok = pair.cached()
    text = _head(data, sizes)
    for _ in range(data.draw(st.integers(2, 5))):
        pair.check(tok, text, data.draw(st.booleans()))
        text += data.draw(TAILS)
    pair.check(tok, text)
    stats = tok.prefix_cache_stats()
    assert stats is not None and stats.hits + stats.misses >= 1


@pytest.mark.parametrize("kind", KINDS)
@PROPS
@given(data=st.data())
def test_texts_that_share_a_prefix_and_diverge(trained: dict[str, Pair], sizes: int, kind: str,
                                               data: st.DataObject) -> None:
    pair = trained[kind]
    tok = pair.cached()
    base = _head(data, sizes) + data.draw(TAILS)
    pair.check(tok, base)
    for _ in range(data.draw(st.integers(1, 4))):
        keep = data.draw(st.integers(0, len(base)))
        other = base[:keep] + data.draw(TAILS)  # a sibling turn, an edit, a truncation
        pair.check(tok, other, data.draw(st.booleans()))
    pair.check(tok, base)  # the very text again: the exact hit


@pytest.mark.parametrize("kind", KINDS)
@PROPS
@given(data=st.data())
def test_whitespace_apostrophes_and_digits_at_the_cut(trained: dict[str, Pair], sizes: int, kind: str,
                                                      data: st.DataObject) -> None:
    pair = trained[kind]
    tok = pair.cached()
    ends = st.sampled_from(["", " ", "  ", "\n", "\n ", " \n", "\n\n  ", "\t", "'", "'l", "'r", "'v", "'L", "1", "12",
                            "x", "<|eot", "<|eot_id|>", "\u00a0"])
    starts = st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "\r\n", "s", "'s", "l", "ll", "'ll", "e", "E", "3", "456",
                              "x", " x", "_id|>", "|>", "\u0301", "😀"])
    text = _head(data, sizes) + data.draw(ends)
    pair.check(tok, text)
    for _ in range(data.draw(st.integers(1, 4))):
        text += data.draw(starts) + data.draw(ends)
        pair.check(tok, text)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head=st.text(min_size=CHUNK_CHARS + 10, max_size=2 * CHUNK_CHARS),
       tails=st.lists(st.text(max_size=60), min_size=1, max_size=4))
def test_random_unicode(trained: dict[str, Pair], kind: str, head: str, tails: list[str]) -> None:
    pair = trained[kind]
    tok = pair.cached()
    text = head
    for tail in tails:
        text += tail
        pair.check(tok, text)


@pytest.mark.parametrize("kind", ["llama3", "cl100k_plain"])
def test_a_run_of_spaces_that_grows_is_not_cut(trained: dict[str, Pair], kind: str) -> None:
    """Why a cut needs a non-space after it: ``"\\n   "`` then ``"\\n"`` is one pre-token for the
    cl100k regex (``\\s*[\\r\\n]+``), so the boundary before the spaces moves."""
    pair = trained[kind]
    head = _random_text(random.Random(5), 400).replace("\n", " ") + "a\n   "
    whole = pair.ref.pre_tokenizer.pre_tokenize_str("a\n   \n")
    assert [p for p, _ in whole] == ["a", "ĊĠĠĠĊ"]  # not "Ċ" | "ĠĠĠ" | "Ċ", as cutting before the run would give
    tok = pair.cached()
    pair.check(tok, head)
    pair.check(tok, head + "\nb")
    stats = tok.prefix_cache_stats()
    assert stats is not None and stats.hits == 1 and stats.misses == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_lone_apostrophe_is_not_cut_after(trained: dict[str, Pair], kind: str) -> None:
    """Why a cut needs room after it: ``'ll`` reads two characters past an apostrophe, so ``"x'"``
    and ``"l"`` then ``"l"`` make ``"'ll"``, not ``"'"`` ``"ll"``."""
    pair = trained[kind]
    tok = pair.cached()
    head = _random_text(random.Random(7), 400) + " x'l"
    for tail in ("", "l", " more", "l more"):
        pair.check(tok, head + tail)


def test_a_conversation_reuses_its_history(trained: dict[str, Pair]) -> None:
    pair = trained["llama3"]
    tok = pair.cached()
    rng = random.Random(8)
    text = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + _random_text(rng, 1500)
    first = len(pair.ref.encode(text, add_special_tokens=False).ids)
    for _ in range(6):
        pair.check(tok, text, special=False)
        text += "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n" + _random_text(rng, 60)
    stats = tok.prefix_cache_stats()
    assert stats is not None and stats.hits == 5 and stats.misses == 1
    assert stats.tokenized_tokens - first < 5 * 150  # each turn: its ~70 new tokens and a few before them
    assert stats.reused_tokens > 5 * first * 0.9
    assert stats.entries == 1  # each turn replaced the one it extends


@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_prefix_is_cut_at_a_checkpoint_inside_it(trained: dict[str, Pair], kind: str) -> None:
    """A long text, then texts that share a prefix of it of any length (a shared system prompt or
    document, an edited turn): they reuse its ids up to a checkpoint before the divergence."""
    pair = trained[kind]
    tok = pair.cached()
    rng = random.Random(11)
    base = _random_text(rng, 3000)
    pair.check(tok, base)
    for _ in range(30):
        pair.check(tok, base[:rng.randint(len(base) // 4, len(base))] + _random_text(rng, rng.randint(0, 20)))
    stats = tok.prefix_cache_stats()
    assert stats is not None and stats.hits >= 25 and stats.reused_tokens > 10 * (stats.tokenized_tokens - len(
        pair.ref.encode(base, add_special_tokens=False).ids))


def test_threads_share_one_cache(trained: dict[str, Pair]) -> None:
    pair = trained["gpt2"]
    tok = pair.cached()
    rng = random.Random(4)
    heads = [_random_text(rng, 400) for _ in range(4)]
    texts = [h + _random_text(rng, 30) * k for h in heads for k in range(6)]
    errors: list[str] = []

    def work(seed: int) -> None:
        order = random.Random(seed).sample(texts, len(texts))
        for t in order:
            if tok.encode(t) != pair.ref.encode(t).ids:
                errors.append(t)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_the_lru_is_bounded_in_entries_and_characters(trained: dict[str, Pair]) -> None:
    pair = trained["gpt2"]
    rng = random.Random(6)
    texts = [f"{i} " + _random_text(rng, 400) for i in range(6)]
    tok = pair.cached(cache_entries=3)
    for t in texts:
        pair.check(tok, t)
    stats = tok.prefix_cache_stats()
    assert stats is not None and stats.entries == 3 and stats.evictions == 3
    pair.check(tok, texts[0] + " more")  # evicted: tokenized whole again
    pair.check(tok, texts[-1] + " more")  # still there: reused
    stats = tok.prefix_cache_stats()
    assert stats is not None and stats.misses == 7 and stats.hits == 1

    bound = 2 * max(map(len, texts)) + 10
    small = pair.cached(cache_chars=bound)
    for t in texts:
        pair.check(small, t)
    stats = small.prefix_cache_stats()
    assert stats is not None and stats.entries == 2 and stats.chars <= bound
    pair.check(small, "y " * bound)  # longer than the whole cache: not stored
    stats = small.prefix_cache_stats()
    assert stats is not None and stats.uncacheable == 1 and stats.entries == 2
    with pytest.raises(ValueError, match="room"):
        pair.cached(cache_entries=0)


def _variant(spec: dict[str, Any], tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder / "tokenizer.json"


def _spec(tok: Tokenizer) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(tok.to_str())
    return spec


@pytest.mark.parametrize("change", ["metaspace", "nfc", "prefix_space", "other_regex", "split_merged", "wordpiece",
                                    "dropout", "lstrip", "truncation", "no_regex", "roberta"])
def test_a_tokenizer_not_proven_safe_turns_the_cache_off(trained: dict[str, Pair], tmp_path: Path, change: str) -> None:
    base = Tokenizer.from_file(str(trained["gpt2"].path))
    tok = base
    if change == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    elif change == "nfc":
        tok.normalizer = normalizers.NFC()
    elif change == "prefix_space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "other_regex":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"(?<=\s)\S+|\s+"), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif change == "split_merged":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(CL100K_PATTERN), "merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif change == "no_regex":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    elif change == "lstrip":
        tok.add_special_tokens([tk_added("<mask>")])
    elif change == "truncation":
        tok.enable_truncation(512)
    elif change == "roberta":
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    spec = _spec(tok)
    if change == "wordpiece":
        spec["model"] = {"type": "WordPiece", "unk_token": "<|endoftext|>", "continuing_subword_prefix": "##",
                         "max_input_chars_per_word": 100, "vocab": {"<|endoftext|>": 0, "a": 1}}
    if change == "dropout":
        spec["model"]["dropout"] = 0.1
    path = _variant(spec, tmp_path, change)
    assert prefix_cache_blocker(spec) is not None
    hf = HFTokenizer(path)
    assert not hf.prefix_cache_enabled and hf.prefix_cache_reason != "on" and hf.prefix_cache_stats() is None
    ref = Tokenizer.from_file(str(path))
    if change != "dropout":  # dropout is random: nothing to compare
        text = _random_text(random.Random(2), 300)
        assert hf.encode(text) == ref.encode(text).ids == list(hf.encode_compact(text))


def tk_added(content: str) -> Any:
    from tokenizers import AddedToken

    return AddedToken(content, lstrip=True)


def test_the_proven_structures_and_the_switch(trained: dict[str, Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    for pair in trained.values():
        assert prefix_cache_blocker(_spec(pair.ref)) is None
        tok = HFTokenizer(pair.path)
        assert tok.prefix_cache_reason == "on"
        text = _random_text(random.Random(1), 400)
        for special in (True, False):
            assert tok.encode(text + "!", special) == pair.ref.encode(text + "!", add_special_tokens=special).ids
            assert tok.encode(text, special) == pair.ref.encode(text, add_special_tokens=special).ids
        assert HFTokenizer(pair.path, prefix_cache=False).prefix_cache_reason == "turned off"
    folder = trained["gpt2"].path.parent
    on = load_tokenizer(folder)
    assert isinstance(on, HFTokenizer) and on.prefix_cache_enabled
    monkeypatch.setenv("KVFLOW_TOKENIZER_PREFIX_CACHE", "off")
    off = load_tokenizer(folder)
    assert isinstance(off, HFTokenizer) and not off.prefix_cache_enabled
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_byte_tokens_need_no_cache() -> None:
    tok = ByteTokenizer()
    assert tok.encode_compact("héllo") == "héllo".encode() and tok.encode("ab") == [97, 98]
