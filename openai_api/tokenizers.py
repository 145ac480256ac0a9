"""Tokenizers shared by nodes and the router (both must cut a prompt into the same token ids).

* :class:`ByteTokenizer`: UTF-8 bytes are the tokens (ids 0–255), EOS = 256. What a node runs
  when its model comes without a ``tokenizer.json`` (the default random model).
* :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, with
  an exact *prefix cache* (:class:`~openai_api.prefix_cache.PrefixCache`): a text that extends (or shares a long prefix
  with) a text tokenized recently reuses that text's ids up to a safe cut and tokenizes only the
  rest. A conversation's next turn re-sends its whole history: with the cache the router
  tokenizes the new turn, not the history (docs/benchmarks.md, "Tokenization cost").

``load_tokenizer(model_dir)`` picks one. No torch here: the router imports this module.

The prefix cache is on by default where the tokenizer's structure proves it exact
(:func:`prefix_cache_blocker`), and off elsewhere; ``KVFLOW_TOKENIZER_PREFIX_CACHE=off`` turns it
off in :func:`load_tokenizer` (nodes and router).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from openai_api.prefix_cache import (
    CL100K_PATTERN,
    DEFAULT_CACHE_CHARS,
    DEFAULT_CACHE_ENTRIES,
    GPT2_PATTERN,
    PROVEN_PATTERNS,
    QWEN2_PATTERN,
    PrefixCache,
    PrefixCacheStats,
    prefix_cache_blocker,
)

__all__ = ["CL100K_PATTERN", "DEFAULT_CACHE_CHARS", "DEFAULT_CACHE_ENTRIES", "GPT2_PATTERN", "PROVEN_PATTERNS",
           "QWEN2_PATTERN", "ByteTokenizer", "HFTokenizer", "PrefixCache", "PrefixCacheStats", "Tokenizer",
           "eos_token_ids", "load_tokenizer", "prefix_cache_blocker"]


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    #: The ids that end a generation (the model folder's EOS: :func:`eos_token_ids`); empty: none.
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens=False``: without the post-processor's BOS/EOS
        (a rendered chat, whose template wrote them)."""
        ...
    def encode_compact(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        """The ids of ``encode``, as the cheapest sequence to hash (``bytes`` for byte tokens)."""
        ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Bytes as tokens: exact, reversible, no vocabulary file (and no prefix cache: encoding is
    already a copy)."""

    name = "bytes"
    vocab_size = 257
    eos_token_ids: tuple[int, ...] = (256,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_compact(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        return text.encode("utf-8")  # bytes: a sequence of the same ids, hashed without a list

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# --- the tokenizers -----------------------------------------------------------------------------


class HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``), with the exact prefix cache where the
    tokenizer's structure allows it (:func:`prefix_cache_blocker`; ``prefix_cache_enabled``,
    ``prefix_cache_reason``, ``prefix_cache_stats()``).

    Args:
        path: the ``tokenizer.json``.
        prefix_cache: False: every text is tokenized whole.
        cache_entries, cache_chars: the cache's bounds (:data:`DEFAULT_CACHE_ENTRIES`: 1,024 texts;
            :data:`DEFAULT_CACHE_CHARS`: 64M characters, ~128 MB at most).
    """

    def __init__(self, path: Path, *, prefix_cache: bool = True, cache_entries: int = DEFAULT_CACHE_ENTRIES,
                 cache_chars: int = DEFAULT_CACHE_CHARS) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.name = f"hf:{path.parent.name}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids(path.parent, self._tok.token_to_id)
        self._cache: PrefixCache | None = None
        spec: dict[str, Any] = json.loads(self._tok.to_str()) if prefix_cache else {}
        blocker = prefix_cache_blocker(spec) if prefix_cache else "turned off"
        if blocker is None:
            cache = PrefixCache(spec, max_entries=cache_entries, max_chars=cache_chars)
            blocker = _probe(self._tok, cache)
            if blocker is None:
                self._cache = cache
        #: why the cache is off ("on" when it is on)
        self.prefix_cache_reason = blocker or "on"

    @property
    def prefix_cache_enabled(self) -> bool:
        return self._cache is not None

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return None if self._cache is None else self._cache.stats()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._cache is not None:
            return self._cache.encode(text, add_special_tokens).tolist()
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_compact(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        if self._cache is not None:
            return self._cache.encode(text, add_special_tokens)  # a u32 array: packed with one copy
        return self.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def _probe(tok: Any, cache: PrefixCache) -> str | None:
    """The template read from the JSON must be what ``tokenizers`` does (else: cache off)."""
    text = "kvflow probe: 12 tokens, or so.\n"
    for special in (True, False):
        want = list(tok.encode(text, add_special_tokens=special).ids)
        if cache.encode(text, special).tolist() != want:
            return "the post-processor does more than the template read from tokenizer.json"
    return None


def eos_token_ids(folder: Path, token_to_id: Callable[[str], int | None]) -> tuple[int, ...]:
    """The ids that end a generation, as transformers' ``generate`` takes them: the
    ``eos_token_id`` of ``generation_config.json`` (an int or a list), else of ``config.json``,
    else the tokenizer config's ``eos_token`` (a string or ``{"content": ...}``) as an id.

    NOTE: the tokenizer config comes last on purpose: converters write it wrong (transformers'
    GGUF import names SmolLM2's ``<|im_start|>`` as its EOS), and the model's own configs are what
    transformers and vLLM honour.
    """
    for name, key in (("generation_config.json", "eos_token_id"), ("config.json", "eos_token_id")):
        f = folder / name
        if not f.is_file():
            continue
        value = json.loads(f.read_text()).get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(dict.fromkeys(value))
    f = folder / "tokenizer_config.json"
    if f.is_file():
        value = json.loads(f.read_text()).get("eos_token")
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tid = token_to_id(value)
            if tid is not None:
                return (int(tid),)
    return ()


def load_tokenizer(model_dir: str | Path | None, *, prefix_cache: bool | None = None) -> Tokenizer:
    """The model folder's ``tokenizer.json`` if there is one, else bytes.

    ``prefix_cache`` None: on unless ``KVFLOW_TOKENIZER_PREFIX_CACHE`` is ``off``/``0``/``false``.
    """
    if prefix_cache is None:
        prefix_cache = os.environ.get("KVFLOW_TOKENIZER_PREFIX_CACHE", "on").lower() not in ("off", "0", "false",
                                                                                                "no")
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path, prefix_cache=prefix_cache)
    return ByteTokenizer()
