"""Tokenizers shared by nodes and the router (both must cut a prompt into the same token ids).

* :class:`ByteTokenizer`: UTF-8 bytes are the tokens (ids 0–255), EOS = 256. What a node runs
  when its model comes without a ``tokenizer.json`` (the default random model).
* :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

``load_tokenizer(model_dir)`` picks one. No torch here: the router imports this module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens=False``: without the post-processor's BOS/EOS
        (a rendered chat, whose template wrote them)."""
        ...
    def encode_compact(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        """The ids of ``encode``, as the cheapest sequence to hash (``bytes`` for byte tokens)."""
        ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Bytes as tokens: exact, reversible, no vocabulary file."""

    name = "bytes"
    vocab_size = 257
    eos_token_id: int | None = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_compact(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        return text.encode("utf-8")  # bytes: a sequence of the same ids, hashed without a list

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.name = f"hf:{path.parent.name}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = _eos_id(path, self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_compact(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        return self.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def _eos_id(path: Path, tok: object) -> int | None:
    """EOS from tokenizer_config.json / config.json next to tokenizer.json, when present."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        f = path.parent / name
        if not f.is_file():
            continue
        value = json.loads(f.read_text()).get(key)
        if isinstance(value, int):
            return value
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tid = tok.token_to_id(value)  # type: ignore[attr-defined]
            if tid is not None:
                return int(tid)
    return None


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """The model folder's ``tokenizer.json`` if there is one, else bytes."""
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path)
    return ByteTokenizer()
