"""A real subword tokenizer for ``kvflow bench route``: a byte-level BPE trained here, on text made here.

* :func:`synthetic_text`: deterministic text from a seed — prose over a Zipf vocabulary of
  made-up words (a long tail that BPE has to split, as real text has), code-like lines
  (identifiers, indentation, brackets) and numbers (integers, decimals, dates, ids).
* :func:`trained_tokenizer`: a ``ByteLevel`` BPE (GPT-2's structure: its regex, no normalizer,
  no prefix space) of a given vocabulary size trained with ``tokenizers`` on that text; the
  ``tokenizer.json`` is kept under a folder named by the parameters, so a rerun loads it.
* :func:`conversations`: multi-turn chats (a system prompt, then user and assistant turns) whose
  prompts grow to several thousand tokens, and cold prompts of the same sizes.
* :func:`trace_prefix_reuse`: the prefix cache's policy (one entry per conversation, least
  recently used out) replayed on the Mooncake trace's block ids: the data behind its default size.
"""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from kvflow.traces import TRACE_BLOCK_TOKENS, TraceRequest

#: Bump when the text or the training changes: the cached tokenizer.json is then retrained.
TEXT_VERSION = 1
_SYLLABLES = ("ka", "lo", "mi", "ra", "te", "su", "no", "vi", "be", "da", "ze", "qu", "ix", "on", "ar", "el", "us",
              "ph", "st", "tr", "gr", "ch", "sh", "ou", "ea", "in", "er", "an", "or", "is", "al", "en", "y", "o",
              "a", "e", "i", "u", "th", "ng", "ck", "wr", "pl", "fl", "br", "sk", "mp", "nd")
_PUNCT = (". ", ". ", ". ", ", ", ", ", "? ", "! ", "; ", ": ", " - ", "'s ", "n't ", " (", ") ", '"', ".\n")
_CODE_WORDS = ("def", "return", "if", "else", "for", "in", "while", "import", "from", "class", "self", "None",
               "True", "False", "await", "async", "let", "const", "fn", "pub", "struct", "impl", "match")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """Made-up words and their Zipf weights (cumulative, for ``random.choices``)."""

    words: list[str]
    cum_weights: list[float]


def vocabulary(seed: int = 1, size: int = 200_000, exponent: float = 1.05) -> Vocabulary:
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < size:
        n = min(8, 1 + int(rng.expovariate(0.45)))
        words.setdefault("".join(rng.choice(_SYLLABLES) for _ in range(n)))
    ranked = list(words)
    return Vocabulary(ranked, list(accumulate(1 / (r + 1) ** exponent for r in range(len(ranked)))))


def _prose(rng: random.Random, vocab: Vocabulary, n_words: int) -> str:
    words = rng.choices(vocab.words, cum_weights=vocab.cum_weights, k=n_words)
    out: list[str] = []
    i = 0
    while i < len(words):
        n = rng.randint(4, 22)
        sentence = words[i:i + n]
        i += n
        if rng.random() < 0.15:
            sentence.insert(rng.randrange(len(sentence)), _number(rng))
        s = " ".join(sentence)
        out.append(s[:1].upper() + s[1:] + rng.choice(_PUNCT))
    return "".join(out)


def _number(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return str(rng.randint(0, 10_000))
    if kind == 1:
        return f"{rng.uniform(0, 1000):.{rng.randint(1, 4)}f}"
    if kind == 2:
        return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 3:
        return f"#{rng.getrandbits(32):08x}"
    return f"{rng.randint(1, 99)}%"


def _code(rng: random.Random, vocab: Vocabulary, n_lines: int) -> str:
    names = rng.choices(vocab.words[:5000], cum_weights=vocab.cum_weights[:5000], k=3 * n_lines)
    lines = []
    depth = 0
    for i in range(n_lines):
        a, b, c = names[3 * i:3 * i + 3]
        kind = rng.randrange(6)
        if kind == 0:
            line, depth2 = f"{rng.choice(_CODE_WORDS)} {a}_{b}({c}, {rng.randint(0, 64)}):", depth + 1
        elif kind == 1:
            line, depth2 = f"{a}.{b} = {c}[{rng.randint(0, 9)}] + {_number(rng)}", depth
        elif kind == 2:
            line, depth2 = f"return {a}({b}={c!r})", max(0, depth - 1)
        elif kind == 3:
            line, depth2 = f"# {a} {b} {c}", depth
        elif kind == 4:
            line, depth2 = f"{a} = {{\"{b}\": [{_number(rng)}, {_number(rng)}], \"{c}\": None}}", depth
        else:
            line, depth2 = f"if {a} != {b}:\t{c}()", depth
        lines.append("    " * depth + line)
        depth = min(depth2, 4)
    return "\n".join(lines) + "\n\n"


def synthetic_text(rng: random.Random, vocab: Vocabulary, n_chars: int) -> str:
    """About ``n_chars`` of prose paragraphs, with a code block now and then."""
    parts: list[str] = []
    size = 0
    while size < n_chars:
        part = _code(rng, vocab, rng.randint(4, 20)) if rng.random() < 0.15 else \
            _prose(rng, vocab, rng.randint(30, 160)) + "\n\n"
        parts.append(part)
        size += len(part)
    return "".join(parts)


def _corpus(vocab: Vocabulary, n_chars: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    made = 0
    while made < n_chars:
        chunk = synthetic_text(rng, vocab, 64_000)
        made += len(chunk)
        yield chunk


def trained_tokenizer(folder: Path, vocab_size: int = 32_768, corpus_chars: int = 24_000_000,
                      vocab: Vocabulary | None = None) -> tuple[Path, float]:
    """A byte-level BPE of ``vocab_size`` ids trained on ``corpus_chars`` of :func:`synthetic_text`:
    the folder holding its ``tokenizer.json``, and the seconds training took (0: loaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = folder / f"bpe-v{TEXT_VERSION}-{vocab_size}-{corpus_chars}"
    path = out / "tokenizer.json"
    if path.is_file():
        return out, 0.0
    vocab = vocab or vocabulary()
    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(_corpus(vocab, corpus_chars, seed=2), trainer)
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"tokenizer.json.{time.monotonic_ns()}"
    tok.save(str(tmp))
    tmp.replace(path)
    (out / "training.json").write_text(json.dumps({"seconds": seconds, "vocab_size": tok.get_vocab_size(),
                                                   "corpus_chars": corpus_chars}))
    return out, seconds


@dataclass(slots=True)
class Conversation:
    """A chat's prompts, one per user turn: each is the previous one, its answer and a question."""

    prompts: list[str]


def conversations(n: int, rng: random.Random, vocab: Vocabulary, *, chars_per_token: float, system_tokens: int = 2048,
                  max_tokens: int = 8192, answer_tokens: tuple[int, int] = (150, 600),
                  question_tokens: tuple[int, int] = (20, 150)) -> list[Conversation]:
    """``n`` chats: a system prompt of ~``system_tokens``, then turns until ~``max_tokens``."""
    def text(tokens: int) -> str:
        n = int(tokens * chars_per_token)
        return synthetic_text(rng, vocab, n)[:n].rsplit(" ", 1)[0].strip()  # ~``tokens``, cut at a word

    out = []
    for _ in range(n):
        prompt = f"System: {text(system_tokens)}\n\nUser: {text(rng.randint(*question_tokens))}\n\nAssistant:"
        prompts = [prompt]
        while len(prompt) < max_tokens * chars_per_token:
            answer, question = text(rng.randint(*answer_tokens)), text(rng.randint(*question_tokens))
            prompt = f"{prompt} {answer}\n\nUser: {question}\n\nAssistant:"
            prompts.append(prompt)
        out.append(Conversation(prompts))
    return out


def trace_prefix_reuse(trace: Sequence[TraceRequest], sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 0),
                       block_tokens: int = TRACE_BLOCK_TOKENS) -> dict[str, object]:
    """Replay the prefix cache's policy on a Mooncake-style trace (``hash_ids``, one per 512 tokens).

    Each request looks up the cached request sharing the most full blocks with it (its previous
    turn, or one with the same system prompt or document), then is cached itself, replacing an
    entry it extends; least recently used out beyond ``size`` entries (0: unbounded). Per size:
    the share of all prompt tokens found cached (what the tokenizer would not redo), the share of
    requests that extend a cached one (a conversation's next turn), and the most tokens held.
    """
    total = sum(r.input_length for r in trace)
    out: dict[str, object] = {"requests": len(trace), "prompt_tokens_mean": round(total / max(1, len(trace)))}
    for size in sizes:
        index: dict[int, int] = {}  # a chain key of blocks -> the latest entry holding that prefix
        lru: OrderedDict[int, list[int]] = OrderedDict()  # entry -> its chain keys
        served = extended = held = 0
        for n, r in enumerate(trace):
            full = r.hash_ids[:-1] if r.input_length % block_tokens else r.hash_ids  # the last block: partial
            keys = list(accumulate(full, lambda h, b: hash((h, b)), initial=0))[1:]
            k = next((k for k in range(len(keys), 0, -1) if keys[k - 1] in index), 0)
            if k:
                served += k * block_tokens
                hit = index[keys[k - 1]]
                lru.move_to_end(hit)
                if len(lru[hit]) == k:
                    extended += 1
                    _forget(index, lru, hit)  # extended: replaced by this request
            lru[n] = keys
            for key in keys:
                index[key] = n
            while size and len(lru) > size:
                _forget(index, lru, next(iter(lru)))
            if n % 256 == 0:
                held = max(held, sum(map(len, lru.values())) * block_tokens)
        out[f"entries_{size}" if size else "unbounded"] = {
            "served_token_share": round(served / total, 4),
            "requests_extending_a_cached_one": round(extended / len(trace), 4), "tokens_held_max": held}
    return out


def _forget(index: dict[int, int], lru: OrderedDict[int, list[int]], entry: int) -> None:
    for key in lru.pop(entry):
        if index.get(key) == entry:
            del index[key]
