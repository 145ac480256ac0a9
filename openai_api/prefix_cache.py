"""The exact prefix cache of :class:`~openai_api.tokenizers.HFTokenizer`: a text that extends (or
shares a long prefix with) a text tokenized recently reuses that text's ids up to a safe cut and
tokenizes only the rest, giving exactly the ids the whole text would get (docs/benchmarks.md,
"Tokenization cost").

:func:`prefix_cache_blocker` says whether a ``tokenizer.json``'s structure proves the cache exact;
:class:`PrefixCache` is the cache. No torch here: the router imports this module.
"""

from __future__ import annotations

import json
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# --- the prefix cache: when a cut is safe ------------------------------------------------------

#: GPT-2's pre-tokenizer regex (``ByteLevel(use_regex=True)``; also as a ``Split``).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
#: cl100k's, as Llama 3 writes it in its ``Split``.
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Qwen2's: cl100k's with one digit a pre-token.
QWEN2_PATTERN = CL100K_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
#: The pre-tokenizer regexes for which :meth:`PrefixCache.safe` is proven (its docstring).
PROVEN_PATTERNS = frozenset({GPT2_PATTERN, CL100K_PATTERN, QWEN2_PATTERN})

#: Defaults of the cache's bounds. Entries: about one per live conversation (an entry that a new
#: text extends is replaced by it). The cache's policy replayed on the Mooncake trace
#: (``kvflow.bench.bpe.trace_prefix_reuse``, docs/benchmarks.md): 1,024 entries find 31.8 % of all
#: prompt tokens cached (85 % of the 37.3 % an unbounded cache finds; 2,048: 36.2 %), holding
#: at most 15.4M tokens, ~62M characters of English. Memory: the texts (1 byte a character for
#: ASCII) plus 4 bytes a token: ~2 bytes a character, ~128 MB at the default bounds.
DEFAULT_CACHE_ENTRIES = 1024
DEFAULT_CACHE_CHARS = 64_000_000
#: Texts are indexed by a hash chain over chunks of this many characters (shorter: not cached).
CHUNK_CHARS = 512
#: A checkpoint (a pre-token boundary to cut at) about every this many tokens.
CHECKPOINT_TOKENS = 128
#: The first non-space character at or after a cut must lie at least this many characters before
#: the last character the texts share (1 would do for the proven regexes: a margin).
SLACK = 2
#: How many pre-token boundaries from a text's end are tried for its last checkpoint.
_TAIL_TRIES = 64


def prefix_cache_blocker(spec: dict[str, Any]) -> str | None:
    """Why the prefix cache cannot be exact for this ``tokenizer.json`` (None: it can).

    Exact means: ``encode(a + b) == encode(a)[:n] + encode(a[p:] + b)`` for the cut ``(p, n)``
    that :class:`PrefixCache` picks. It is proven for this structure only:

    * no normalizer (one that looks across characters — NFC composes a character with the next
      one, Metaspace's prepend adds a character at the start — changes what a cut means);
    * a byte-level pre-tokenizer that splits with a regex of :data:`PROVEN_PATTERNS` (no
      lookbehind, no anchors) and adds no prefix space: ``ByteLevel(use_regex=True)``, or
      ``Sequence[Split(<regex>, Isolated), ByteLevel(use_regex=False)]`` (GPT-2, Llama 3);
    * a BPE model without dropout (BPE runs inside each pre-token, the same every time);
    * a post-processor that only adds special tokens around the text (``TemplateProcessing``,
      ``ByteLevel``'s offsets, a ``Sequence`` of them): added once, around the whole text;
    * added tokens without ``lstrip``/``rstrip``/``single_word`` (they look at their neighbours);
      no truncation, no padding.

    Anything else (Metaspace/SentencePiece tokenizers, WordPiece, unknown components): the cache
    is off and every text is tokenized whole.
    """
    norm = spec.get("normalizer")
    if norm is not None and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
        return f"normalizer {norm.get('type')}: not proven prefix-stable"
    why = _pre_tokenizer_blocker(spec.get("pre_tokenizer"))
    if why:
        return why
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')}: only BPE is proven"
    if model.get("dropout") not in (None, 0, 0.0):
        return "BPE dropout: not deterministic"
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "truncation or padding is set"
    for tok in spec.get("added_tokens") or []:
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
            return f"added token {tok.get('content')!r} strips or matches whole words"
    wrap = _template(spec.get("post_processor"))
    return wrap if isinstance(wrap, str) else None


def _pre_tokenizer_blocker(pre: dict[str, Any] | None) -> str | None:
    if pre is None:
        return "no pre-tokenizer: one pre-token, no place to cut"
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("add_prefix_space", True):
            return "ByteLevel add_prefix_space: the rest of a cut text would get a space"
        return None if pre.get("use_regex", True) else "ByteLevel without a regex: one pre-token"
    if kind == "Sequence":
        parts = pre.get("pretokenizers") or []
        if len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel":
            split, byte_level = parts
            if split.get("pattern", {}).get("Regex") not in PROVEN_PATTERNS:
                return "Split regex not proven prefix-stable"
            if split.get("behavior") != "Isolated" or split.get("invert"):
                return "Split behaviour other than Isolated"
            if byte_level.get("add_prefix_space", True) or byte_level.get("use_regex", True):
                return "ByteLevel after Split with a prefix space or a regex of its own"
            return None
    return f"pre-tokenizer {kind}: not proven prefix-stable"


def _template(post: dict[str, Any] | None) -> tuple[list[int], list[int]] | str:
    """The ids a post-processor puts before and after the text, or why it is not just that."""
    if post is None:
        parts: list[dict[str, Any]] = []
    else:
        parts = (post.get("processors") or []) if post.get("type") == "Sequence" else [post]
    before: list[int] = []
    after: list[int] = []
    templates = 0
    for part in parts:
        kind = part.get("type")
        if kind == "ByteLevel":
            continue  # offsets only
        if kind != "TemplateProcessing":
            return f"post-processor {kind}: not proven"
        templates += 1
        seen_text = False
        for item in part.get("single") or []:
            if "Sequence" in item and item["Sequence"].get("id") == "A" and not seen_text:
                seen_text = True
            elif "SpecialToken" in item:
                ids = part["special_tokens"][item["SpecialToken"]["id"]]["ids"]
                (after if seen_text else before).extend(int(i) for i in ids)
            else:
                return "TemplateProcessing item not proven"
        if not seen_text:
            return "TemplateProcessing without the text"
    if templates > 1:
        return "more than one TemplateProcessing"
    return before, after


@dataclass(slots=True)
class _Entry:
    """A text tokenized recently: its raw ids (no post-processor) and where it may be cut."""

    key: int
    text: str
    ids: array[int]
    #: checkpoints: character positions of pre-token boundaries (increasing) and tokens before each
    cut_pos: array[int]
    cut_tok: array[int]
    chunk_keys: list[int]


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters of a :class:`PrefixCache` (since it was made)."""

    #: texts that reused a cached prefix (``exact``: the very text again)
    hits: int
    exact: int
    #: texts tokenized whole (long enough to look up, nothing to reuse)
    misses: int
    #: tokens taken from the cache, and tokens the ``tokenizers`` library produced
    reused_tokens: int
    tokenized_tokens: int
    entries: int
    chars: int
    evictions: int
    #: texts not stored: longer than the whole cache
    uncacheable: int


def _chunk_keys(text: str) -> list[int]:
    """Key ``k`` identifies ``text[:(k + 1) * CHUNK_CHARS]`` (a hash chain over the chunks)."""
    keys: list[int] = []
    h = 0
    for end in range(CHUNK_CHARS, len(text) + 1, CHUNK_CHARS):
        h = hash((h, text[end - CHUNK_CHARS:end]))
        keys.append(h)
    return keys


def _common_prefix(a: str, b: str, start: int) -> int:
    """The length of the common prefix of ``a`` and ``b``, given they agree on ``[:start]``."""
    end = min(len(a), len(b))
    if a[start:end] == b[start:end]:
        return end
    lo = start
    while lo + CHUNK_CHARS <= end and a[lo:lo + CHUNK_CHARS] == b[lo:lo + CHUNK_CHARS]:
        lo += CHUNK_CHARS
    hi = min(lo + CHUNK_CHARS, end)  # a[:lo] == b[:lo]; they differ before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo if a[lo] != b[lo] else lo + 1


class PrefixCache:
    """Exact prefix tokenization: a bounded LRU of recent texts → their ids and safe cut points.

    **Lookup.** Every cached text is indexed by a hash chain over its chunks of
    :data:`CHUNK_CHARS` characters; a new text computes its own chain (~1 µs a kilobyte) and takes
    the deepest chunk some entry shares, verified by comparing the characters (a hash collision
    only costs a miss); ``shared`` is then the exact length of the common prefix. Tens of
    microseconds for a 32k-character prompt, against ~1.5 µs a token for ``tokenizers`` itself.

    **The cut.** An entry keeps *checkpoints*: pre-token boundaries (where the encoding's
    ``token_to_word`` changes; the position is the token's start offset, which ``tokenizers``
    gives in characters and, without a post-processor, untrimmed) every :data:`CHECKPOINT_TOKENS`
    tokens, plus the last one that is safe for any extension of the text. For a new text sharing
    ``shared`` characters, the cut is the last checkpoint ``p`` that :meth:`safe` accepts; the
    result is the entry's first ``n`` ids and ``tokenizers``' ids of ``text[p:]``.

    **Why it is exact.** ``tokenizers`` cuts the text at added tokens, pre-tokenizes each piece
    with the regex (a left-to-right scan) and runs BPE inside each pre-token. The scan of the new
    text equals the entry's scan as long as the regex engine only looked at characters before
    ``shared``; once it has produced a match ending at ``p``, the rest is the scan of ``text[p:]``
    (the proven regexes have no lookbehind or anchors). For the proven regexes a match ending at
    or before ``p`` looks at most at ``max(p + 1, w)``, ``w`` the first non-space character at or
    after ``p``: ``\\s+(?!\\S)`` and ``\\s*[\\r\\n]+`` read a whole run of spaces and the
    character after it (so a cut inside or just before a run of spaces at the end is not safe: the
    run may grow, and ``"\\n  "`` + ``"\\n"`` is one pre-token), ``'ll`` reads one character past
    a lone apostrophe. Added tokens are matched leftmost-longest: a match starting at ``a`` is
    decided by ``[a, a + longest)``, and ends the piece the regex scans. Hence :meth:`safe`. BPE of
    equal pre-tokens gives equal ids; the post-processor's special tokens go around the joined
    ids once.

    **Bounds.** At most ``max_entries`` texts and ``max_chars`` characters (least recently used out
    first). A text that extends an entry replaces it: a conversation keeps one entry, its latest
    turn. Thread-safe (a lock around the index; tokenizing runs outside it).
    """

    def __init__(self, spec: dict[str, Any], *, max_entries: int = DEFAULT_CACHE_ENTRIES,
                 max_chars: int = DEFAULT_CACHE_CHARS) -> None:
        from tokenizers import Tokenizer as _Tok

        if max_entries < 1 or max_chars < CHUNK_CHARS:
            raise ValueError("a prefix cache needs room for one text")
        wrap = _template(spec.get("post_processor"))
        if isinstance(wrap, str):
            raise ValueError(wrap)
        self._before = array("I", wrap[0])
        self._after = array("I", wrap[1])
        # The same tokenizer without its post-processor: the text's own ids, untrimmed offsets.
        self._tok = _Tok.from_str(json.dumps({**spec, "post_processor": None}))
        self._longest_added = max((len(str(t["content"])) for t in spec.get("added_tokens") or []), default=0)
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self._next_key = 0
        self._chars = 0
        self._counts = dict.fromkeys(("hits", "exact", "misses", "reused_tokens", "tokenized_tokens", "evictions",
                                      "uncacheable"), 0)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(entries=len(self._entries), chars=self._chars, **self._counts)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> array[int]:
        """Exactly ``tokenizers``' ``encode(text, add_special_tokens).ids``, as a ``u32`` array."""
        raw = self._raw(text)
        if not add_special_tokens or not (self._before or self._after):
            return raw
        out = array("I", self._before)
        out.extend(raw)
        out.extend(self._after)
        return out

    def _raw(self, text: str) -> array[int]:
        """The ids of ``text`` without the post-processor (a fresh array the caller may keep)."""
        if len(text) < CHUNK_CHARS:
            return array("I", self._tok.encode(text, add_special_tokens=False).ids)
        keys = _chunk_keys(text)
        with self._lock:
            found = self._find(text, keys)
            if found is not None and found[0].text == text:
                self._touch(found[0])
                self._counts["hits"] += 1
                self._counts["exact"] += 1
                self._counts["reused_tokens"] += len(found[0].ids)
                return array("I", found[0].ids)
            cut = None if found is None else self._cut(found[0], found[1])
            if cut is None:
                self._counts["misses"] += 1
        p, n = cut if cut is not None else (0, 0)
        enc = self._tok.encode(text[p:] if p else text, add_special_tokens=False)
        new: list[int] = enc.ids
        marks = self._checkpoints(text, p, n, enc, len(new))
        if found is not None and cut is not None:
            entry = found[0]
            raw = entry.ids[:n]
            raw.extend(new)
            j = bisect_right(entry.cut_pos, p)
            cut_pos, cut_tok = entry.cut_pos[:j], entry.cut_tok[:j]
        else:
            raw, cut_pos, cut_tok = array("I", new), array("q"), array("q")
        with self._lock:
            self._counts["tokenized_tokens"] += len(new)
            if cut is not None:
                self._counts["hits"] += 1
                self._counts["reused_tokens"] += n
            if len(text) > self.max_chars:
                self._counts["uncacheable"] += 1
            else:
                cut_pos.extend(marks[0])
                cut_tok.extend(marks[1])
                # an entry the text extends is of no more use: the text serves whatever it served
                replaces = found[0] if found is not None and found[1] == len(found[0].text) else None
                self._store(text, keys, raw, cut_pos, cut_tok, replaces)
        return array("I", raw)

    def safe(self, text: str, p: int, shared: int) -> bool:
        """Whether a pre-token boundary ``p`` of ``text`` is a safe cut for any text that shares
        ``text[:shared]``: ``p > 0``, the first non-space character ``w`` at or after ``p`` lies at
        ``shared - 1 - SLACK`` or before, and an added token starting at or before ``w + 1`` is
        decided within ``shared`` (``w + 1 + longest added token <= shared``)."""
        if p <= 0:
            return False
        seg = text[p:shared - SLACK]
        rest = seg.lstrip()  # str.isspace() holds for every regex \s (and a few more: stricter)
        if not rest:
            return False
        w = p + len(seg) - len(rest)
        return not self._longest_added or w + 1 + self._longest_added <= shared

    def _find(self, text: str, keys: list[int]) -> tuple[_Entry, int] | None:
        """The entry sharing the longest chunk prefix with ``text``, and the exact shared length."""
        for k in range(len(keys) - 1, -1, -1):
            entry = self._index.get(keys[k])
            if entry is None:
                continue
            end = (k + 1) * CHUNK_CHARS
            if not entry.text.startswith(text[:end]):
                continue  # a hash collision
            return entry, _common_prefix(text, entry.text, end)
        return None

    def _cut(self, entry: _Entry, shared: int) -> tuple[int, int] | None:
        """The last checkpoint of ``entry`` that is safe for ``shared`` characters: (position, tokens)."""
        j = bisect_right(entry.cut_pos, shared) - 1
        for i in range(j, max(-1, j - _TAIL_TRIES), -1):
            if self.safe(entry.text, entry.cut_pos[i], shared):
                return entry.cut_pos[i], entry.cut_tok[i]
        return None

    def _checkpoints(self, text: str, base: int, base_tok: int, enc: Any, n: int) -> tuple[list[int], list[int]]:
        """Checkpoints in ``text[base:]``, whose encoding is ``enc`` (``n`` tokens; ``base_tok``
        before it): a pre-token boundary every :data:`CHECKPOINT_TOKENS` tokens, then the last one
        that is safe for any extension of ``text``; character positions in ``text``, tokens before each."""
        word, start = enc.token_to_word, enc.token_to_chars
        pos: list[int] = []
        toks: list[int] = []
        j = CHECKPOINT_TOKENS
        while j < n:
            while j < n and word(j) == word(j - 1):
                j += 1
            if j >= n:
                break
            pos.append(base + start(j)[0])
            toks.append(base_tok + j)
            j += CHECKPOINT_TOKENS
        tries = 0
        for j in range(n - 1, toks[-1] - base_tok if toks else 0, -1):
            if word(j) == word(j - 1):
                continue
            q = base + start(j)[0]
            if self.safe(text, q, len(text)):
                pos.append(q)
                toks.append(base_tok + j)
                break
            tries += 1
            if tries >= _TAIL_TRIES:
                break
        return pos, toks

    def _touch(self, entry: _Entry) -> None:
        self._entries.move_to_end(entry.key)
        for k in entry.chunk_keys:
            self._index[k] = entry

    def _store(self, text: str, keys: list[int], ids: array[int], cut_pos: array[int], cut_tok: array[int],
               replaces: _Entry | None) -> None:
        entry = _Entry(self._next_key, text, ids, cut_pos, cut_tok, keys)
        self._next_key += 1
        self._entries[entry.key] = entry
        self._chars += len(text)
        for k in keys:  # first: the keys it shares with the entry it replaces stay in the index
            self._index[k] = entry
        if replaces is not None and replaces.key in self._entries:
            self._drop(replaces)
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            self._drop(next(iter(self._entries.values())))
            self._counts["evictions"] += 1

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self._chars -= len(entry.text)
        for k in entry.chunk_keys:
            if self._index.get(k) is entry:
                del self._index[k]
