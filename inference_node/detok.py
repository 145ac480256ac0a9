"""Incremental detokenization: a sequence's text, grown one token at a time, exactly as decoding
all its tokens at once would give it (no broken characters in between).

Decoding token by token is wrong for most tokenizers: a byte token may end inside a UTF-8
character, and subword decoders drop or add spaces at a sequence's start. The scheme is vLLM's
(``detokenize_incrementally``): decode a short window ``tokens[prefix:]`` and emit what it adds to
``tokens[prefix:read]``, and only once it does not end in an incomplete character (U+FFFD); then
the window moves on. So ``text`` grows by whole characters, and at the end (:meth:`finish`) it is
the decoding of every token.
"""

from __future__ import annotations

from openai_api.tokenizers import Tokenizer


class Detokenizer:
    """One sequence's text (see the module docstring)."""

    __slots__ = ("_prefix", "_read", "text", "tokenizer", "tokens")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # tokens[_prefix:_read] were decoded into the end of `text`
        self._read = 0

    def add(self, token: int) -> str:
        """Add one token; returns the text it completes ("" while a character is incomplete)."""
        self.tokens.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text still held (an incomplete character, decoded as U+FFFD); ``text`` is then whole."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix:self._read]) if self._read > self._prefix else ""
        now = decode(self.tokens[self._prefix:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        delta = now[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(self.tokens)
        return delta
