"""What the cache core needs to know about a request's prompt: its block digests and length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eventbus.hashing import block_digest, chain_digests
from eventbus.protocol import BlockDigest


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as blocks.

    Attributes:
        digests: digests of the prompt's full blocks, chained (``eventbus.hashing``).
        num_tokens: prompt length in tokens (the last block may be partial).
        token_ids: the tokens, when known; needed to hash blocks filled during decode and to put
            token ids into events. None for synthetic prompts (trace replays).
        lora_id: LoRA adapter id (already part of the digests).
        cache_salt: tenant salt (already part of the first digest); decode blocks chain from the
            prompt's blocks, so it carries over.
    """

    digests: tuple[BlockDigest, ...]
    num_tokens: int
    token_ids: tuple[int, ...] | None = None
    lora_id: int | None = None
    cache_salt: str | None = None

    @classmethod
    def from_tokens(cls, token_ids: Sequence[int], block_size: int, *, lora_id: int | None = None,
                    cache_salt: str | None = None) -> Prompt:
        digests = chain_digests(token_ids, block_size, lora_id=lora_id, cache_salt=cache_salt)
        return cls(tuple(digests), len(token_ids), tuple(token_ids), lora_id, cache_salt)

    @classmethod
    def from_block_keys(cls, keys: Sequence[int], block_size: int, num_tokens: int | None = None,
                        *, lora_id: int | None = None) -> Prompt:
        """A synthetic prompt whose i-th full block is named by ``keys[i]`` (e.g. a trace hash id).

        Block i's digest chains on block i-1's, as for real tokens, so equal key prefixes are equal
        block prefixes. ``num_tokens`` defaults to ``len(keys) * block_size``; a larger value adds
        a partial tail block.
        """
        digests: list[BlockDigest] = []
        parent: bytes | None = None
        for k in keys:
            parent = block_digest(parent, (k & 0xFFFFFFFF, k >> 32), lora_id=lora_id, num_tokens=block_size)
            digests.append(parent)
        n = len(keys) * block_size if num_tokens is None else num_tokens
        if not len(keys) * block_size <= n < (len(keys) + 1) * block_size:
            raise ValueError(f"num_tokens {n} does not fit {len(keys)} full blocks of {block_size} "
                             "plus at most a partial one")
        return cls(tuple(digests), n, None, lora_id, None)
